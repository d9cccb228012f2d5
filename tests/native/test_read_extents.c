/* fp_read_extents with its copy-out helper thread, from C: built with
 * ThreadSanitizer by tests/run_native.sh, where Python cannot be (libtsan
 * must be loaded first, and CPython is not built for it). Every compiled
 * engine reads a file of known bytes into many unaligned destinations,
 * several buffers deep, with and without CRCs, also past the end of the
 * file and with a read failing midway (fault injection). Exit status 0 and
 * no sanitizer report means the copy-out is race-free on these paths.
 *
 * Usage: test_read_extents FOLDER */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fp_engine.h"

#define FILE_SIZE (24u << 20)
#define MAX_EXTENTS 512

static unsigned char *expected;
static int failures;

#define CHECK(cond, ...)                                        \
    do {                                                        \
        if (!(cond)) {                                          \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                       \
            fputc('\n', stderr);                                \
            failures++;                                         \
        }                                                       \
    } while (0)

static void write_file(const char *path)
{
    expected = malloc(FILE_SIZE);
    uint32_t x = 12345;
    for (size_t i = 0; i < FILE_SIZE; i++) {
        x = x * 1103515245u + 12345u;
        expected[i] = (unsigned char)(x >> 16);
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0 || write(fd, expected, FILE_SIZE) != (ssize_t)FILE_SIZE || fsync(fd) != 0) {
        perror(path);
        exit(2);
    }
    close(fd);
}

/* Sorted, disjoint extents: adjacent ones, small gaps (read through), gaps
 * of more than a request (skipped), odd lengths; the last runs `past_end`
 * bytes beyond the file. Destinations are separate, unaligned allocations. */
static size_t make_extents(struct fp_extent *ext, unsigned seed, uint64_t past_end)
{
    size_t n = 0;
    uint64_t pos = seed % 4096;
    srand(seed);
    while (n < MAX_EXTENTS - 1) {
        uint64_t gap = (rand() % 4 == 0) ? (uint64_t)(rand() % (600 << 10)) : (uint64_t)(rand() % 64);
        uint64_t len = 1 + (uint64_t)(rand() % (300 << 10));
        if (pos + gap + len > FILE_SIZE)
            break;
        pos += gap;
        ext[n].offset = pos;
        ext[n].length = len;
        ext[n].dst = (char *)malloc(len + 1) + 1;
        n++;
        pos += len;
    }
    if (past_end) {
        ext[n].offset = FILE_SIZE - 5000;
        ext[n].length = 5000 + past_end;
        ext[n].dst = (char *)malloc(ext[n].length + 1) + 1;
        n++;
    }
    for (size_t i = 0; i < n; i++)
        memset(ext[i].dst, 0xAA, ext[i].length);
    return n;
}

static void free_extents(struct fp_extent *ext, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free((char *)ext[i].dst - 1);
}

static int engine(int kind, struct fp_engine **e)
{
    /* small buffers: a 24 MiB read is many buffers deep, so the helper runs */
    struct fp_config cfg = {kind, 256u << 10, 4, 8, 64u << 10, 0};
    return fp_engine_create(&cfg, e);
}

static void read_all(int kind, const char *path, int direct, int with_crcs, uint64_t past_end)
{
    struct fp_engine *e;
    int rc = engine(kind, &e);
    if (rc < 0) {
        printf("skip kind %d: %s\n", kind, strerror(-rc));
        return;
    }
    int bfd = open(path, O_RDONLY), dfd = direct ? open(path, O_RDONLY | O_DIRECT) : -1;
    static struct fp_extent ext[MAX_EXTENTS];
    static uint32_t crcs[MAX_EXTENTS];
    size_t n = make_extents(ext, (unsigned)(kind * 7 + direct * 3 + with_crcs + past_end), past_end);
    memset(crcs, 0, sizeof(crcs));
    uint64_t want = 0;
    for (size_t i = 0; i < n; i++)
        want += ext[i].offset + ext[i].length > FILE_SIZE ? FILE_SIZE - ext[i].offset : ext[i].length;
    uint64_t progress = 0;
    int64_t got = fp_read_extents_progress(e, dfd, bfd, ext, n, with_crcs ? crcs : NULL, &progress);
    CHECK(got == (int64_t)want, "kind %d direct %d: copied %lld of %llu", kind, direct, (long long)got,
          (unsigned long long)want);
    uint64_t last_end = ext[n - 1].offset + ext[n - 1].length;
    CHECK(progress >= (last_end < FILE_SIZE ? last_end : FILE_SIZE) && progress <= FILE_SIZE + (1u << 20),
          "kind %d direct %d: progress %llu at the end, the extents end at %llu", kind, direct,
          (unsigned long long)progress, (unsigned long long)last_end);
    for (size_t i = 0; i < n; i++) {
        uint64_t present = ext[i].offset + ext[i].length > FILE_SIZE ? FILE_SIZE - ext[i].offset : ext[i].length;
        CHECK(memcmp(ext[i].dst, expected + ext[i].offset, present) == 0, "kind %d extent %zu: wrong bytes", kind, i);
        if (with_crcs)
            CHECK(crcs[i] == fp_crc32(0, expected + ext[i].offset, present), "kind %d extent %zu: wrong CRC", kind, i);
    }
    free_extents(ext, n);
    if (dfd >= 0)
        close(dfd);
    close(bfd);
    fp_engine_destroy(e);
}

/* The 20th read request fails: the read returns -EIO with the helper
 * holding handed-over buffers, and the engine refuses further use. */
static void read_failing(int kind, const char *path)
{
    setenv("FASTPERSIST_FAULT_INJECT", "read:20:EIO", 1);
    struct fp_engine *e;
    int rc = engine(kind, &e);
    unsetenv("FASTPERSIST_FAULT_INJECT");
    if (rc < 0)
        return;
    int bfd = open(path, O_RDONLY), dfd = open(path, O_RDONLY | O_DIRECT);
    static struct fp_extent ext[MAX_EXTENTS];
    size_t n = make_extents(ext, 99u + (unsigned)kind, 0);
    for (size_t i = 0; i < n; i++)
        memset(ext[i].dst, 0, ext[i].length);
    uint64_t progress = 0;
    int64_t got = fp_read_extents_progress(e, dfd, bfd, ext, n, NULL, &progress);
    CHECK(got == -EIO, "kind %d: a failing read returned %lld, not -EIO", kind, (long long)got);
    CHECK(progress < ext[n - 1].offset + ext[n - 1].length, "kind %d: a failed read's progress passed its end", kind);
    for (size_t i = 0; i < n && ext[i].offset + ext[i].length <= progress; i++) /* what progress promised */
        CHECK(memcmp(ext[i].dst, expected + ext[i].offset, ext[i].length) == 0,
              "kind %d extent %zu: below the progress of a failed read, wrong bytes", kind, i);
    CHECK(fp_engine_usable(e) == -ENOTRECOVERABLE, "kind %d: a failed engine is still usable", kind);
    free_extents(ext, n);
    close(dfd);
    close(bfd);
    fp_engine_destroy(e);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s FOLDER\n", argv[0]);
        return 2;
    }
    char path[4096];
    snprintf(path, sizeof(path), "%s/read_extents.bin", argv[1]);
    write_file(path);
    int kinds[] = {FP_ENGINE_PSYNC, FP_ENGINE_AIO, FP_ENGINE_URING};
    for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
        if (!fp_kind_compiled(kinds[k])) {
            printf("skip kind %d: not compiled in\n", kinds[k]);
            continue;
        }
        for (int direct = 0; direct <= 1; direct++)
            for (int with_crcs = 0; with_crcs <= 1; with_crcs++)
                read_all(kinds[k], path, direct, with_crcs, 0);
        read_all(kinds[k], path, 1, 1, 70000); /* the file ends inside the last extent */
        read_failing(kinds[k], path);
    }
    unlink(path);
    free(expected);
    if (failures) {
        fprintf(stderr, "%d failures\n", failures);
        return 1;
    }
    printf("ok\n");
    return 0;
}
