/*
 * packed_file.c — a model's repacked weights kept in a file
 * (es_model_params.repack_cache), so that a later load maps them instead of
 * repacking: no copy, no fresh pages to zero (most of a repack's time), and
 * the pages are the page cache's, shared by every process that maps them.
 *
 * Layout: a header of HEADER_BYTES (magic, the es_packed_key it was written
 * for, a digest of the weights keyed with the cache's secret), then the
 * repacked weights exactly as repack_weights lays them out in memory. The
 * repack writes straight into a mapping of a file of its own beside path
 * (no second copy of the weights, no fresh anonymous pages), which is
 * renamed over path, unsynced (a sync of a GB takes seconds on some disks):
 * a file cut short or zero-filled by a crash before the system wrote it out
 * fails the digest, and is written again. The first load that maps a file
 * checks the whole digest and leaves a stamp of what it verified beside it
 * (file_stamp: keyed, and void once the file is written to); later loads
 * that find the stamp read no more than the header.
 *
 * What sits at path is trusted only when it is a regular file (never
 * through a symlink, never a FIFO an open would block on) of this user's
 * that no group or other user may write; anything else is left as it is
 * and the load repacks in memory (ES_PACKED_FILE_FOREIGN).
 */
#define _DEFAULT_SOURCE  // pread, mkstemp, posix_fallocate, O_NOFOLLOW
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "native/native_internal.h"

#define HEADER_BYTES 4096   // the weights start page-aligned in the mapping
static const char MAGIC[8] = "ESPACK1\n";

typedef struct header {
    char          magic[8];
    es_packed_key key;
    uint64_t      digest;  // weights_digest of the weights
} header;

static inline uint64_t rotl(uint64_t x, int b) { return (x << b) | (x >> (64 - b)); }

static void sipround(uint64_t v[4]) {
    v[0] += v[1], v[1] = rotl(v[1], 13), v[1] ^= v[0], v[0] = rotl(v[0], 32);
    v[2] += v[3], v[3] = rotl(v[3], 16), v[3] ^= v[2];
    v[0] += v[3], v[3] = rotl(v[3], 21), v[3] ^= v[0];
    v[2] += v[1], v[1] = rotl(v[1], 17), v[1] ^= v[2], v[2] = rotl(v[2], 32);
}

// SipHash-2-4 (Aumasson and Bernstein's keyed pseudorandom function) of n
// 64-bit words under the 128-bit key k.
static uint64_t siphash_words(const uint64_t k[2], const uint64_t * words, size_t n) {
    uint64_t v[4] = { k[0] ^ 0x736f6d6570736575ULL, k[1] ^ 0x646f72616e646f6dULL,
                      k[0] ^ 0x6c7967656e657261ULL, k[1] ^ 0x7465646279746573ULL };
    for (size_t i = 0; i < n; i++) {
        v[3] ^= words[i];
        sipround(v), sipround(v);
        v[0] ^= words[i];
    }
    const uint64_t last = (uint64_t) (n * 8) << 56;   // the length byte of an empty final block
    v[3] ^= last;
    sipround(v), sipround(v);
    v[0] ^= last;
    v[2] ^= 0xff;
    for (int r = 0; r < 4; r++) sipround(v);
    return v[0] ^ v[1] ^ v[2] ^ v[3];
}

#define LANES 16   // of 32 bits: vectors of them multiply in one instruction on SSE4.1, AVX2 and NEON

// One step of a lane: a bijection of x for a given h, and of h for a given x,
// so one changed word always changes its lane's end value.
static inline uint32_t lane_step(uint32_t h, uint32_t x) {
    h = (h ^ x) * 0x85ebca6bu;
    return h ^ (h >> 15);
}

// A digest of n bytes (n a multiple of 32: whole groups of repacked blocks)
// keyed with secret (ES_REPACK_SECRET_BYTES), at memory speed: LANES
// independent multiply-xor lanes over the 32-bit words (word i in lane
// i % LANES) start from the secret's second half (their values are
// unknowable without it), and SipHash under its first half turns the lanes
// and n into the digest. Whoever alters the weights cannot write the digest
// that goes with them without the secret (a plain digest could be
// recomputed by anyone); SipHash over all of a GB would take 5-10 times the
// lanes' time, which the compiler vectorizes.
#if defined(__x86_64__) && defined(__GNUC__)
// The lanes' loop in AVX2 where the CPU has it (32-bit multiplies are SSE4.1:
// the baseline x86-64 build multiplies each lane alone): the same digest in
// half the time.
__attribute__((target_clones("avx2", "default")))
#endif
static uint64_t weights_digest(const uint8_t * secret, const void * data, size_t n) {
    uint64_t k[4];
    memcpy(k, secret, sizeof k);
    uint32_t seed[4], h[LANES];
    memcpy(seed, k + 2, sizeof seed);
    for (int l = 0; l < LANES; l++) h[l] = seed[l % 4] ^ (0x9e3779b9u * (uint32_t) (l + 1));
    const uint8_t * p = data;
    size_t i = 0;
    for (; i + sizeof h <= n; i += sizeof h) {
        uint32_t x[LANES];
        memcpy(x, p + i, sizeof x);
        for (int l = 0; l < LANES; l++) h[l] = lane_step(h[l], x[l]);
    }
    for (; i + 4 <= n; i += 4) {   // the last words, fewer than LANES
        uint32_t x;
        memcpy(&x, p + i, sizeof x);
        const size_t l = i / 4 % LANES;
        h[l] = lane_step(h[l], x);
    }
    uint64_t words[LANES / 2 + 1];
    memcpy(words, h, sizeof h);
    words[LANES / 2] = (uint64_t) n;
    return siphash_words(k, words, LANES / 2 + 1);
}

#define SAMPLES    16     // pages of tensor data hashed, evenly spread
#define SAMPLE     4096

uint64_t es__packed_source(const es_gguf * g, const char * path) {
    // The file as the system knows it (a replaced or rewritten file changes
    // these; its ctime, which no user can set, changes with every write even
    // where the mtime is set back, as rsync --inplace -t does), its whole
    // header (metadata and tensor table), and samples of its tensor data (a
    // copy with the same size and times but other weights).
    // The samples are read, not touched through the mapping: a fault there
    // maps the page cache's whole folio around it (megabytes of experts an
    // expert cache keeps out of the process).
    uint64_t h = ES_FNV_OFFSET;
    size_t size;
    const uint8_t * bytes = es__gguf_bytes(g, &size);
    const size_t start = (size_t) es_gguf_data_offset(g), span = size - start;
    h = es__fnv1a(h, bytes, start);
    struct stat st;
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    bool same = false;   // the file at path is still the one mapped (its size, at least)
    if (fd >= 0 && fstat(fd, &st) == 0 && (size_t) st.st_size == size) {
        same = true;
        const int64_t id[] = { (int64_t) st.st_size, (int64_t) st.st_mtim.tv_sec, (int64_t) st.st_mtim.tv_nsec,
                               (int64_t) st.st_ctim.tv_sec, (int64_t) st.st_ctim.tv_nsec,
                               (int64_t) st.st_ino, (int64_t) st.st_dev };
        h = es__fnv1a(h, id, sizeof id);
        uint8_t page[SAMPLE];
        for (int i = 0; i < SAMPLES && span >= SAMPLE; i++) {
            const off_t at = (off_t) (start + (span - SAMPLE) / (SAMPLES - 1) * (size_t) i);
            const ssize_t n = pread(fd, page, SAMPLE, at);
            h = es__fnv1a(h, page, n > 0 ? (size_t) n : 0);
        }
    }
    if (fd >= 0) close(fd);
    return same ? h : 0;
}

// A pack whose digest a load verified gets a stamp beside it (path + ".ok"):
// SipHash under the secret of the file's device, inode, size and ctime.
// Any write to the pack changes its ctime (which no user can set back), so a
// stamp that still matches proves the bytes are those verified, and a load
// maps the pack without reading all of it again; forging a stamp takes the
// secret, as forging the digest does.
static uint64_t file_stamp(const uint8_t * secret, const struct stat * st) {
    uint64_t k[2];
    memcpy(k, secret, sizeof k);
    const uint64_t id[] = { (uint64_t) st->st_dev, (uint64_t) st->st_ino, (uint64_t) st->st_size,
                            (uint64_t) st->st_ctim.tv_sec, (uint64_t) st->st_ctim.tv_nsec };
    return siphash_words(k, id, sizeof id / sizeof id[0]);
}

static bool stamp_matches(const char * path, uint64_t stamp) {
    char name[4096];
    if (snprintf(name, sizeof name, "%s.ok", path) >= (int) sizeof name) return false;
    const int fd = open(name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) return false;
    uint64_t got = 0;
    struct stat st;
    const bool ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && pread(fd, &got, sizeof got, 0) == sizeof got;
    close(fd);
    return ok && got == stamp;
}

// Best effort (a stamp not written costs the next load a digest): written
// beside, then renamed.
static void stamp_write(const char * path, uint64_t stamp) {
    char name[4096], part[4096];
    if (snprintf(name, sizeof name, "%s.ok", path) >= (int) sizeof name ||
        snprintf(part, sizeof part, "%s.ok.part-%ld", path, (long) getpid()) >= (int) sizeof part) return;
    const int fd = open(part, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) return;
    const bool ok = write(fd, &stamp, sizeof stamp) == sizeof stamp;
    if (close(fd) != 0 || !ok || rename(part, name) != 0) unlink(part);
}

int es__packed_file_map(const char * path, const es_packed_key * key, const uint8_t * secret, const void ** out,
                        void ** map, size_t * map_size) {
    *out = NULL, *map = NULL, *map_size = 0;
    // Not through a symlink (ELOOP), and never waiting on a FIFO's writer.
    const int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) return errno == ELOOP ? ES_PACKED_FILE_FOREIGN : ES_ERR_IO;
    header h;
    struct stat st;
    int rc = ES_OK;
    if (fstat(fd, &st) != 0) rc = ES_ERR_IO;
    else if (!S_ISREG(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & (S_IWGRP | S_IWOTH))) {
        rc = ES_PACKED_FILE_FOREIGN;
    } else if (pread(fd, &h, sizeof h, 0) != (ssize_t) sizeof h) rc = ES_ERR_IO;
    else if (memcmp(h.magic, MAGIC, sizeof MAGIC) != 0 || memcmp(&h.key, key, sizeof *key) != 0 ||
             (uint64_t) st.st_size != HEADER_BYTES + key->bytes) {
        rc = ES_ERR_FORMAT;   // written for another file or layout, or cut short
    }
    if (rc == ES_OK) {
        void * m = mmap(NULL, (size_t) st.st_size, PROT_READ, MAP_SHARED, fd, 0);
        const uint64_t stamp = file_stamp(secret, &st);
        if (m == MAP_FAILED) rc = ES_ERR_IO;
        else if (stamp_matches(path, stamp)) {
            *map = m, *map_size = (size_t) st.st_size, *out = (const uint8_t *) m + HEADER_BYTES;
        } else if (weights_digest(secret, (const uint8_t *) m + HEADER_BYTES, key->bytes) != h.digest) {
            munmap(m, (size_t) st.st_size);
            rc = ES_ERR_FORMAT;   // damaged, never wholly written out, or not written with this secret
        } else {
            stamp_write(path, stamp);
            *map = m, *map_size = (size_t) st.st_size, *out = (const uint8_t *) m + HEADER_BYTES;
        }
    }
    close(fd);
    return rc;
}

int es__packed_file_begin(const char * path, size_t bytes, es_packed_writer * w, uint8_t ** weights) {
    // A name of this writer's own: two processes loading the model at once
    // each write theirs, and the last rename wins with a whole file. The
    // name carries the writer's pid, so that the part a killed load left is
    // known for a dead writer's (path.part-<pid>-<6 random characters>).
    *w = (es_packed_writer) { .fd = -1 };
    *weights = NULL;
    // mkstemp fills in the X's; a path too long for the name is the caller's error.
    const int n = snprintf(w->part, sizeof w->part, "%s.part-%ld-XXXXXX", path, (long) getpid());
    if (n >= (int) sizeof w->part) return ES_ERR_INVALID_ARG;
    w->fd = mkstemp(w->part);
    if (w->fd < 0) return ES_ERR_IO;
    w->size = HEADER_BYTES + bytes;
    // The blocks are reserved first: a full disk is this error now, never a
    // fault while the repack writes through the mapping.
    void * m = MAP_FAILED;
    if (fchmod(w->fd, 0644) == 0 && posix_fallocate(w->fd, 0, (off_t) w->size) == 0) {
        m = mmap(NULL, w->size, PROT_READ | PROT_WRITE, MAP_SHARED, w->fd, 0);
    }
    if (m == MAP_FAILED) {
        es__packed_file_abandon(w);
        return ES_ERR_IO;
    }
    w->map = m;
    *weights = (uint8_t *) m + HEADER_BYTES;
    return ES_OK;
}

int es__packed_file_commit(es_packed_writer * w, const char * path, const es_packed_key * key,
                           const uint8_t * secret) {
    header h = { .key = *key, .digest = weights_digest(secret, (const uint8_t *) w->map + HEADER_BYTES, key->bytes) };
    memcpy(h.magic, MAGIC, sizeof MAGIC);
    memcpy(w->map, &h, sizeof h);
    const bool ok = close(w->fd) == 0 && rename(w->part, path) == 0;
    w->fd = -1;
    if (!ok) unlink(w->part);  // the mapping stays valid: the weights serve this load all the same
    return ok ? ES_OK : ES_ERR_IO;
}

void es__packed_file_abandon(es_packed_writer * w) {
    if (w->map) munmap(w->map, w->size);
    if (w->fd >= 0) close(w->fd);
    if (w->fd >= 0 || w->map) unlink(w->part);
    *w = (es_packed_writer) { .fd = -1 };
}
