"""``fastpersist bench``: fastpersist measured on this machine, against
vanilla torch and the raw engine, the way checkpoints are used.

- ``default``: save (new file, over an existing one) and load (fresh process,
  same process, load_into) of a ~2 GB model (``fastpersist bench``);
- ``sweep``: the engine options, CSV and a PNG plot (``fastpersist bench sweep``);
- ``restart``: LLM checkpoint and restart times (``fastpersist bench restart``);
- ``models``: the model registry (GPT-2, Llama, Phi-3 shapes, random weights);
- ``common``: folders, page-cache dropping, fresh processes, tables and files.

The command line is in fastpersist/cli.py. tqdm and matplotlib are optional
dependencies (``pip install 'fastpersist[bench]'``); this package imports
nothing heavy until a command runs.
"""
