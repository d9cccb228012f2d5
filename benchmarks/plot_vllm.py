"""The chart of docs/inference-servers.md, from a `fastpersist bench vllm --json` file:
python benchmarks/plot_vllm.py benchmarks/results/vllm-cpu-2026-11-28.json docs/img/vllm.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REGIMES = ("cold", "warm", "tmpfs")


def main(source: str, target: str) -> None:
    with open(source) as f:
        document = json.load(f)
    seconds: dict = {}
    for row in document["results"]:
        if row["operation"].startswith("load weights"):
            seconds.setdefault(row["mechanism"], {})[row["operation"].rsplit(", ", 1)[-1]] = row["median_s"]
    mechanisms = [m for m in seconds if not m.startswith("plain read")]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / len(mechanisms)
    for i, mechanism in enumerate(mechanisms):
        xs = [r + i * width for r in range(len(REGIMES))]
        bar = ax.bar(xs, [seconds[mechanism].get(r, 0) for r in REGIMES], width, label=mechanism)
        if mechanism == "fastpersist":
            for patch in bar:
                patch.set_edgecolor("black")
                patch.set_linewidth(1.5)
    plain = seconds.get(next((m for m in seconds if m.startswith("plain read")), ""), {})
    for r, regime in enumerate(REGIMES):
        if regime in plain:
            ax.hlines(plain[regime], r - width / 2, r + 0.8 - width / 2, colors="grey", linestyles="dashed")
    ax.set_xticks([r + 0.4 - width / 2 for r in range(len(REGIMES))])
    ax.set_xticklabels([f"{r} (dashed: plain read)" for r in REGIMES])
    ax.set_ylabel("load_weights, seconds (median)")
    ax.set_title(f"vLLM {document.get('vllm', '')}: {document['results'][0]['bytes'] / 1e9:.2f} GB of weights, "
                 f"fresh processes, {document['machine']['cpus']} CPUs ({document['date']})", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(target, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
