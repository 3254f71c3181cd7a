/*
 * expert_cache.c — expert weights read from disk into a cache under a byte
 * budget, for MoE models larger than the memory given to them (HOBBIT's
 * scheme on this engine).
 *
 *   slots       the budget cut into slots of one expert each (gate, up and
 *               down together): full-precision slots, and (BALANCED, FAST)
 *               smaller ones for low-precision copies, each pool its own
 *               share of the budget
 *   I/O thread  reads queued slots with pread (not through the mapping, and
 *               drops the pages read from the page cache with
 *               posix_fadvise(DONTNEED), so no second copy stays in memory);
 *               a batch's misses first, then prefetches
 *   precision   a miss of an expert whose routing weight is small is served
 *               from the sidecar's Q2_K / Q3_K copy (BALANCED, FAST); EXACT
 *               never substitutes (and has no low slots), so its output is
 *               the unlimited engine's
 *   prefetch    es_moe_ffn names the experts later layers' routers pick for
 *               this layer's input; the depth adapts to how many of them
 *               are used
 *   policy      ADAPTIVE evicts the expert of least decaying frequency per
 *               layer of distance to its next use (the layers run in a
 *               cycle, so the one just used is the furthest); LRU the least
 *               recently used
 *
 * Locking: one mutex guards every slot's state, the queue and the counters;
 * a slot's bytes are written by the I/O thread while LOADING only, and read
 * by the compute threads after get() saw it READY under the mutex.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "native/native_internal.h"

enum { SLOT_EMPTY, SLOT_QUEUED, SLOT_LOADING, SLOT_READY, SLOT_FAILED };

// BALANCED serves a miss from the low-precision copy when the expert's
// routing weight is below this fraction of the mean weight of the top k,
// 1 / k (0.25 for top 2; top 8 spreads its weights: 0.0625).
#define BALANCED_THRESHOLD 0.5f
// BALANCED's low-precision slots: this share of the budget, and at least
// two layers' active experts (the rest full ones, at least one layer's).
// Small, since a copy serves misses of experts that matter little to the
// token now, and the full slots are what keeps the hit rate up.
#define BALANCED_LOW_SHARE 0.05
// Sidecar layout (little-endian): the header of SIDECAR_HEADER bytes
//   0 magic[8]  8 u32 version  12 u32 type of gate and up  16 u32 n_layer
//   20 u32 n_expert  24 u64 n_embd  32 u64 n_ff  40 u64 model file size
//   48 u64 model identity (checksum of its metadata plus those of its
//   routers)  56 u64 expert stride  64 u64 data offset  72 u32 type of down
//   76 u32 0  80 u64 checksum of bytes 0..79,
// then one u64 checksum per (layer, expert), then at the data offset the
// copies (gate | up | down, zero-padded), expert stride bytes each. The
// types are any the kernels read (moe prepare writes Q2_K or Q3_K, Q4_0
// for rows that are not whole 256-element super-blocks).
enum { SIDECAR_VERSION = 2, SIDECAR_HEADER = 88, SLOT_ALIGN = 64 };

typedef struct slot {
    int32_t   layer, expert;  // what it holds; layer < 0: nothing
    int8_t    low;            // the low-precision copy
    int8_t    state;          // SLOT_*
    int8_t    prefetched;     // read by prefetch this many layers ahead (at most
                              // ES_PREFETCH_DEPTHS) and not used since; 0: not
    int32_t   held;           // begin .. end holds
    int       rc;             // SLOT_FAILED: the read's status
    uint64_t  last_use;       // tick of the last begin naming it
    double    freq;           // uses, decayed, as of freq_tick
    uint64_t  freq_tick;
    uint8_t * data;           // (slot_bytes, or low_slot_bytes) inside the arena
} slot;

struct es_expert_cache {
    int32_t n_layer, n_expert, k;
    // Per layer and matrix (a file may store some layers' experts in
    // another type: llama.cpp's Q4_K_M gives half the down matrices Q6_K):
    int32_t * type;           // (n_layer, 3) the file's type
    size_t  * slab;           // (n_layer, 3) bytes of one expert's matrix
    size_t  * off;            // (n_layer, 3) its offset in a slot
    int64_t * file_off;       // (n_layer, 3) file offset of each expert stack
    int32_t low_type[3];      // the sidecar's type of each matrix
    size_t  low_slab[3], low_off[3], low_stride;
    int64_t low_data_off;
    uint64_t * low_sum;       // (n_layer, n_expert) checksums of the copies; NULL: no sidecar
    int fd, low_fd;
    struct stat st0;          // the model file when loaded
    int32_t precision, policy, max_depth;
    size_t  slot_bytes, low_slot_bytes;
    int32_t n_slots, n_full;  // slots 0 .. n_full - 1 full size, the rest low-precision
    uint8_t * arena;          // n_full slots of slot_bytes, then low ones of low_slot_bytes
    slot    * slots;          // (n_slots)
    int32_t * map[2];         // (n_layer, n_expert) slot of each full / low copy; -1: none
    int32_t   cur_layer;
    int32_t * cur_slot;       // (n_expert) the slot begin() chose for each expert of cur_layer
    int32_t * held;           // (n_slots) slots held since begin
    int32_t   n_held;
    int32_t * queue;          // (n_slots) slots to read, in order
    int32_t   q_len;
    pthread_mutex_t mu;
    pthread_cond_t  work, done;
    pthread_t io;
    bool      io_started, stop;
    uint64_t  tick;           // begins so far
    int32_t   depth;          // prefetch depth now
    int64_t   win_pref[ES_PREFETCH_DEPTHS], win_used[ES_PREFETCH_DEPTHS];  // by depth, since the
                                   // last adaptation: prefetches, and those used
    int32_t   windows;             // adaptations so far
    int64_t   win_stall_ns, win_tokens;  // decoding's wait for reads, and tokens, in the window
    double    stall_at[ES_PREFETCH_DEPTHS + 1];  // ns of stall per token at each depth (mean of
                                                  // the last windows there); < 0: not measured
    uint64_t  win_tick;
    es_expert_provider provider;
    es_expert_stats st;
    char err[256];
};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t) ts.tv_sec * 1000000000 + ts.tv_nsec;
}

uint64_t es_sidecar_checksum(const void * data, size_t n) {
    const uint8_t * p = data;
    uint64_t h = 0;
    for (size_t i = 0; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h += w * (2 * (uint64_t) (i / 8) + 1);
    }
    return h;
}

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// Reads n bytes at off in full; ES_ERR_IO on an error or end of file.
static int pread_full(int fd, void * dst, size_t n, int64_t off) {
    uint8_t * d = dst;
    while (n > 0) {
        const ssize_t r = pread(fd, d, n, (off_t) off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return ES_ERR_IO;
        d += r;
        n -= (size_t) r;
        off += r;
    }
    return ES_OK;
}

/* ---- the I/O thread ------------------------------------------------------- */

// Reads one slot's expert; no lock held. err: the reason on failure.
static int read_expert(es_expert_cache * c, int32_t il, int32_t e, bool low, uint8_t * dst,
                       size_t * bytes, char * err, size_t err_cap) {
    struct stat st;
    if (fstat(c->fd, &st) != 0 || st.st_size != c->st0.st_size ||
        st.st_mtim.tv_sec != c->st0.st_mtim.tv_sec ||
        st.st_mtim.tv_nsec != c->st0.st_mtim.tv_nsec) {
        snprintf(err, err_cap, "the model file changed on disk since it was loaded");
        return ES_ERR_IO;
    }
    *bytes = 0;
    if (low) {
        const int64_t off = c->low_data_off + ((int64_t) il * c->n_expert + e) *
                            (int64_t) c->low_stride;
        if (pread_full(c->low_fd, dst, c->low_stride, off) != ES_OK) {
            snprintf(err, err_cap, "reading layer %d expert %d from the sidecar: %s", (int) il,
                     (int) e, errno ? strerror(errno) : "short read");
            return ES_ERR_IO;
        }
        posix_fadvise(c->low_fd, (off_t) off, (off_t) c->low_stride, POSIX_FADV_DONTNEED);
        *bytes = c->low_stride;
        if (es_sidecar_checksum(dst, c->low_stride) != c->low_sum[il * c->n_expert + e]) {
            snprintf(err, err_cap, "the sidecar's copy of layer %d expert %d fails its checksum",
                     (int) il, (int) e);
            return ES_ERR_IO;
        }
        return ES_OK;
    }
    for (int w = 0; w < 3; w++) {
        const size_t slab = c->slab[il * 3 + w];
        const int64_t off = c->file_off[il * 3 + w] + (int64_t) e * (int64_t) slab;
        if (pread_full(c->fd, dst + c->off[il * 3 + w], slab, off) != ES_OK) {
            snprintf(err, err_cap, "reading layer %d expert %d from the model: %s", (int) il,
                     (int) e, errno ? strerror(errno) : "short read");
            return ES_ERR_IO;
        }
        posix_fadvise(c->fd, (off_t) off, (off_t) slab, POSIX_FADV_DONTNEED);
        *bytes += slab;
    }
    return ES_OK;
}

static void * io_main(void * arg) {
    es_expert_cache * c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->stop && c->q_len == 0) pthread_cond_wait(&c->work, &c->mu);
        if (c->stop) break;
        slot * s = &c->slots[c->queue[0]];
        memmove(c->queue, c->queue + 1, (size_t) --c->q_len * sizeof *c->queue);
        s->state = SLOT_LOADING;
        const int32_t il = s->layer, e = s->expert;
        const bool low = s->low;
        pthread_mutex_unlock(&c->mu);

        char err[sizeof c->err];
        size_t bytes = 0;
        errno = 0;
        const int rc = read_expert(c, il, e, low, s->data, &bytes, err, sizeof err);

        pthread_mutex_lock(&c->mu);
        s->state = rc == ES_OK ? SLOT_READY : SLOT_FAILED;
        s->rc = rc;
        if (rc != ES_OK) memcpy(c->err, err, sizeof err);
        c->st.bytes_read += (int64_t) bytes;
        pthread_cond_broadcast(&c->done);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* ---- slots and the policy ------------------------------------------------- */

// Layers from the one computed now to s's next use (0: this one).
static int32_t distance(const es_expert_cache * c, int32_t layer) {
    return (layer - c->cur_layer + c->n_layer) % c->n_layer;
}

static double decayed_freq(const es_expert_cache * c, const slot * s) {
    const double half_life = 4.0 * c->n_layer;  // ticks: four tokens' worth of layers
    return s->freq * exp2(-(double) (c->tick - s->freq_tick) / half_life);
}

// How much keeping s is worth: the smallest is evicted.
static double value(const es_expert_cache * c, const slot * s) {
    if (c->policy == ES_POLICY_LRU) return (double) s->last_use;
    return decayed_freq(c, s) / (1.0 + distance(c, s->layer));
}

static void queue_remove(es_expert_cache * c, int32_t si) {
    for (int32_t i = 0; i < c->q_len; i++) {
        if (c->queue[i] == si) {
            memmove(c->queue + i, c->queue + i + 1, (size_t) (c->q_len - i - 1) * sizeof *c->queue);
            c->q_len--;
            return;
        }
    }
}

// Queues si: a demand read after the other demand reads, ahead of prefetches.
static void queue_add(es_expert_cache * c, int32_t si, bool demand) {
    int32_t at = c->q_len;
    if (demand) {
        at = 0;
        while (at < c->q_len && !c->slots[c->queue[at]].prefetched) at++;
    }
    memmove(c->queue + at + 1, c->queue + at, (size_t) (c->q_len - at) * sizeof *c->queue);
    c->queue[at] = si;
    c->q_len++;
}

static void forget(es_expert_cache * c, slot * s) {
    if (s->layer >= 0) {
        c->map[s->low][s->layer * c->n_expert + s->expert] = -1;
        if (s->state == SLOT_READY) c->st.evictions++;
    }
    s->layer = -1;
    s->state = SLOT_EMPTY;
    s->prefetched = 0;
}

// The slots of full copies or of low-precision ones: [*lo, *hi).
static void pool(const es_expert_cache * c, bool low, int32_t * lo, int32_t * hi) {
    *lo = low ? c->n_full : 0;
    *hi = low ? c->n_slots : c->n_full;
}

// A slot of the pool `low` to reuse for a read of `layer`, or -1. Demand
// reads take any slot not held and not being read, cancelling queued
// prefetches if need be, and wait for reads to end when none is free. A
// prefetch takes an empty slot, or evicts only what the policy values below
// an expert needed sooner.
static int32_t victim(es_expert_cache * c, int32_t layer, bool demand, bool low) {
    int32_t lo, hi;
    pool(c, low, &lo, &hi);
    for (;;) {
        int32_t best = -1;
        double best_v = 0.0;
        for (int32_t i = lo; i < hi; i++) {
            const slot * s = &c->slots[i];
            if (s->layer < 0) return i;
            if (s->held || (s->state != SLOT_READY && s->state != SLOT_FAILED)) continue;
            if (!demand) {
                if (s->prefetched) continue;
                if (c->policy == ES_POLICY_LRU ? s->last_use == c->tick
                                               : distance(c, s->layer) <= distance(c, layer)) {
                    continue;
                }
            }
            const double v = value(c, s);
            if (best < 0 || v < best_v) { best = i; best_v = v; }
        }
        if (best >= 0 || !demand) return best;
        // Demand: cancel the last queued prefetch, else wait for a read to end.
        for (int32_t i = c->q_len - 1; i >= 0; i--) {
            slot * s = &c->slots[c->queue[i]];
            if (!s->held && s->prefetched && c->queue[i] >= lo && c->queue[i] < hi) {
                const int32_t si = c->queue[i];
                queue_remove(c, si);
                // Never read: no load, no prefetch after all.
                c->st.loads--;
                c->st.prefetches--;
                c->st.prefetches_at[s->prefetched - 1]--;
                c->win_pref[s->prefetched - 1]--;
                forget(c, s);
                return si;
            }
        }
        bool loading = false;
        for (int32_t i = lo; i < hi; i++) {
            loading |= !c->slots[i].held && (c->slots[i].state == SLOT_LOADING ||
                                             c->slots[i].state == SLOT_QUEUED);
        }
        if (!loading) return -1;
        pthread_cond_wait(&c->done, &c->mu);
    }
}

// Claims a slot for (layer, expert, low) and queues its read, a demand
// read or (depth > 0) a prefetch that many layers ahead; -1: none free.
static int32_t claim(es_expert_cache * c, int32_t layer, int32_t e, bool low, int32_t depth) {
    const bool demand = depth == 0;
    const int32_t si = victim(c, layer, demand, low);
    if (si < 0) return -1;
    slot * s = &c->slots[si];
    forget(c, s);
    s->layer = layer;
    s->expert = e;
    s->low = low;
    s->state = SLOT_QUEUED;
    s->prefetched = (int8_t) (depth < ES_PREFETCH_DEPTHS ? depth : ES_PREFETCH_DEPTHS);
    s->freq = demand ? 0.0 : 1.0;  // a prefetch counts as the use it predicts
    s->freq_tick = c->tick;
    s->last_use = c->tick;
    c->map[low][layer * c->n_expert + e] = si;
    // A full copy makes the expert's low-precision one useless: its slot is free.
    const int32_t lo = low ? -1 : c->map[1][layer * c->n_expert + e];
    if (lo >= 0 && !c->slots[lo].held &&
        (c->slots[lo].state == SLOT_READY || c->slots[lo].state == SLOT_FAILED)) {
        forget(c, &c->slots[lo]);
    }
    queue_add(c, si, demand);
    c->st.loads++;  // counted when queued: the counters read mid-generation add up
    pthread_cond_signal(&c->work);
    return si;
}

// Whether a miss of an expert of this importance is served from its low-precision copy.
static bool substitute(const es_expert_cache * c, float importance) {
    if (!c->low_sum || c->precision == ES_PRECISION_EXACT) return false;
    return c->precision == ES_PRECISION_FAST || importance < BALANCED_THRESHOLD / (float) c->k;
}

// The cached slot of (layer, e, low), -1: none (a failed read is dropped).
static int32_t lookup(es_expert_cache * c, int32_t layer, int32_t e, bool low) {
    const int32_t si = c->map[low][layer * c->n_expert + e];
    if (si >= 0 && c->slots[si].state == SLOT_FAILED && !c->slots[si].held) {
        forget(c, &c->slots[si]);
        return -1;
    }
    return si;
}

// Every 4 * n_layer ticks (4 tokens), from that window's counts. Whether
// prefetching pays is measured, not assumed: a right guess hides a read,
// but a wrong one costs a read that delays the misses, and either evicts
// an expert that may be needed (on a disk-bound run prefetching can cost
// more than it hides). So the depth moves to whichever of depth - 1,
// depth, depth + 1 showed the least stall per token (means of their last
// windows), trying a neighbour not measured yet first; never deeper than a
// depth whose guesses were mostly wrong (fewer than PREFETCH_PAYS used),
// and back to the deepest one that paid when one did not. Every
// FORGET_WINDOWS windows the other depths' figures are forgotten, as the
// text (and what is cached) changes. Never more slots than half the cache.
#define PREFETCH_PAYS 0.5
enum { PREFETCH_EVIDENCE = 8, FORGET_WINDOWS = 16 };

static void adapt_depth(es_expert_cache * c) {
    if (c->tick - c->win_tick < 4 * (uint64_t) c->n_layer) return;
    const int32_t cap = c->n_slots / (2 * c->k) > 1 ? c->n_slots / (2 * c->k) : 1;
    int32_t top = c->max_depth < cap ? c->max_depth : cap;  // the deepest allowed
    if (top > ES_PREFETCH_DEPTHS) top = ES_PREFETCH_DEPTHS;
    int32_t paid = 0;  // every depth 1 .. paid paid (or had too few prefetches to tell)
    while (paid < c->depth && paid < ES_PREFETCH_DEPTHS) {
        const int64_t n = c->win_pref[paid], used = c->win_used[paid];
        if (n >= PREFETCH_EVIDENCE && (double) used < PREFETCH_PAYS * (double) n) break;
        paid++;
    }
    if (c->win_tokens > 0) {
        const double stall = (double) c->win_stall_ns / (double) c->win_tokens;
        double * at = &c->stall_at[c->depth];
        *at = *at < 0.0 ? stall : 0.5 * (*at + stall);
    }
    if (++c->windows % FORGET_WINDOWS == 0) {
        for (int32_t d = 0; d <= ES_PREFETCH_DEPTHS; d++) {
            if (d != c->depth) c->stall_at[d] = -1.0;
        }
    }
    int32_t next = c->depth;
    if (paid < c->depth) {
        next = paid;
    } else {
        const int32_t lo = c->depth > 0 ? c->depth - 1 : 0;
        const int32_t hi = c->depth < top ? c->depth + 1 : c->depth;
        for (int32_t d = lo; d <= hi; d++) {
            if (c->stall_at[d] < 0.0) { next = d; break; }  // not measured yet: try it
            if (c->stall_at[d] < c->stall_at[next]) next = d;
        }
    }
    c->depth = next > top ? top : next;
    memset(c->win_pref, 0, sizeof c->win_pref);
    memset(c->win_used, 0, sizeof c->win_used);
    c->win_tick = c->tick;
    c->win_stall_ns = c->win_tokens = 0;
}

/* ---- the provider ---------------------------------------------------------- */

static int cache_begin(void * self, int32_t layer, int32_t n_tokens, int32_t n,
                       const int32_t * experts, const float * importance) {
    es_expert_cache * c = self;
    pthread_mutex_lock(&c->mu);
    if (layer == 0) {
        c->st.tokens += n_tokens;
        c->win_tokens += n_tokens;
    }
    c->tick++;
    c->cur_layer = layer;
    if (c->max_depth > 0) adapt_depth(c);
    int rc = ES_OK;
    for (int32_t i = 0; i < n && rc == ES_OK; i++) {
        const int32_t e = experts[i];
        c->st.lookups++;
        int32_t si = lookup(c, layer, e, false);
        bool low = false;
        if (si < 0 && substitute(c, importance[i])) {
            low = true;
            si = lookup(c, layer, e, true);
        }
        if (si >= 0) {
            c->st.hits++;
            slot * s = &c->slots[si];
            if (s->prefetched) {
                c->st.prefetch_used++;
                c->st.prefetch_used_at[s->prefetched - 1]++;
                c->win_used[s->prefetched - 1]++;
                s->prefetched = 0;
                if (s->state == SLOT_QUEUED) {  // now a demand read: to the front
                    queue_remove(c, si);
                    queue_add(c, si, true);
                }
            }
        } else {
            si = claim(c, layer, e, low, 0);
            // No low slot free (all held by this batch): the full copy.
            if (si < 0 && low && c->n_full > 0) si = claim(c, layer, e, false, 0);
            if (si < 0) rc = ES_ERR_NO_MEMORY;  // more held than slots: not with max_held
        }
        if (rc == ES_OK) {
            slot * s = &c->slots[si];
            c->st.substitutions += s->low;
            s->held++;
            s->last_use = c->tick;
            s->freq = decayed_freq(c, s) + 1.0;
            s->freq_tick = c->tick;
            c->cur_slot[e] = si;
            c->held[c->n_held++] = si;
        }
    }
    if (rc != ES_OK) {
        for (int32_t i = 0; i < c->n_held; i++) c->slots[c->held[i]].held--;
        c->n_held = 0;
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

static int cache_get(void * self, int32_t layer, int32_t e, int32_t which, es_expert_view * out) {
    es_expert_cache * c = self;
    (void) layer;  // the layer of the last begin
    pthread_mutex_lock(&c->mu);
    slot * s = &c->slots[c->cur_slot[e]];
    if (s->state == SLOT_QUEUED || s->state == SLOT_LOADING) {
        const int64_t t0 = now_ns();
        while (s->state == SLOT_QUEUED || s->state == SLOT_LOADING) {
            pthread_cond_wait(&c->done, &c->mu);
        }
        c->st.stall_ns += now_ns() - t0;
        c->win_stall_ns += now_ns() - t0;
    }
    const int rc = s->state == SLOT_READY ? ES_OK : s->rc;
    const bool low = s->low;
    pthread_mutex_unlock(&c->mu);
    if (rc != ES_OK) return rc;
    out->data = s->data + (low ? c->low_off[which] : c->off[s->layer * 3 + which]);
    out->type = low ? c->low_type[which] : c->type[s->layer * 3 + which];
    return ES_OK;
}

static void cache_put(void * self, int32_t layer, int32_t e, int32_t which,
                      const es_expert_view * view) {
    (void) self; (void) layer; (void) e; (void) which; (void) view;
}

static void cache_end(void * self, int32_t layer) {
    es_expert_cache * c = self;
    (void) layer;
    pthread_mutex_lock(&c->mu);
    for (int32_t i = 0; i < c->n_held; i++) c->slots[c->held[i]].held--;
    c->n_held = 0;
    pthread_mutex_unlock(&c->mu);
}

static void cache_prefetch(void * self, int32_t layer, int32_t n, const int32_t * experts,
                           const float * importance) {
    es_expert_cache * c = self;
    pthread_mutex_lock(&c->mu);
    for (int32_t i = 0; i < n; i++) {
        const int32_t e = experts[i];
        if (lookup(c, layer, e, false) >= 0) continue;
        const bool low = substitute(c, importance[i]);
        if (low && lookup(c, layer, e, true) >= 0) continue;
        // (es_moe_ffn prefetches for layers after the one begun last, of this token)
        const int32_t depth = layer > c->cur_layer ? layer - c->cur_layer : 1;
        const int32_t si = claim(c, layer, e, low, depth);
        if (si >= 0) {
            c->st.prefetches++;
            c->st.prefetches_at[c->slots[si].prefetched - 1]++;
            c->win_pref[c->slots[si].prefetched - 1]++;
        }
    }
    pthread_mutex_unlock(&c->mu);
}

static int32_t cache_prefetch_depth(void * self) {
    es_expert_cache * c = self;
    pthread_mutex_lock(&c->mu);
    const int32_t d = c->depth;
    pthread_mutex_unlock(&c->mu);
    return d;
}

/* ---- setup ------------------------------------------------------------------ */

static uint32_t rd32(const uint8_t * p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t rd64(const uint8_t * p) { uint64_t v; memcpy(&v, p, 8); return v; }

// Opens and checks the sidecar against the model; fills the low_* fields.
static int open_sidecar(es_expert_cache * c, const es_gguf * g, const char * path, int64_t D,
                        int64_t F, char * err, size_t err_cap) {
    c->low_fd = open(path, O_RDONLY | O_CLOEXEC);
    if (c->low_fd < 0) {
        snprintf(err, err_cap, "cannot open the expert sidecar %s: %s", path, strerror(errno));
        return ES_ERR_IO;
    }
    uint8_t h[SIDECAR_HEADER];
    struct stat st;
    if (fstat(c->low_fd, &st) != 0 || pread_full(c->low_fd, h, sizeof h, 0) != ES_OK ||
        memcmp(h, ES_SIDECAR_MAGIC, 8) != 0) {
        snprintf(err, err_cap, "%s is not an edgespec expert sidecar", path);
        return ES_ERR_FORMAT;
    }
    if (rd32(h + 8) != SIDECAR_VERSION) {
        snprintf(err, err_cap, "sidecar %s: version %u is not supported (%d): run edgespec moe "
                 "prepare again", path, rd32(h + 8), SIDECAR_VERSION);
        return ES_ERR_FORMAT;
    }
    if (es_sidecar_checksum(h, 80) != rd64(h + 80)) {
        snprintf(err, err_cap, "sidecar %s: its header fails its checksum", path);
        return ES_ERR_FORMAT;
    }
    const struct { const char * what; uint64_t got, want; } same[] = {
        { "layers", rd32(h + 16), (uint64_t) c->n_layer },
        { "experts", rd32(h + 20), (uint64_t) c->n_expert },
        { "embedding width", rd64(h + 24), (uint64_t) D },
        { "expert width", rd64(h + 32), (uint64_t) F },
        { "model file size", rd64(h + 40), (uint64_t) c->st0.st_size },
    };
    for (size_t i = 0; i < sizeof same / sizeof same[0]; i++) {
        if (same[i].got != same[i].want) {
            snprintf(err, err_cap, "sidecar %s was made for another model: %s %llu, this model "
                     "has %llu", path, same[i].what, (unsigned long long) same[i].got,
                     (unsigned long long) same[i].want);
            return ES_ERR_FORMAT;
        }
    }
    // The model's metadata and tensor infos, which fix every tensor's place,
    // and its routers, which differ between models of one shape: each
    // checksummed zero-padded to 8 bytes, the checksums added.
    const size_t meta = (size_t) es_gguf_data_offset(g);
    uint8_t * buf = calloc(round_up(meta, 8), 1);
    if (!buf) return ES_ERR_NO_MEMORY;
    int rc = pread_full(c->fd, buf, meta, 0);
    uint64_t sum = es_sidecar_checksum(buf, round_up(meta, 8));
    free(buf);
    for (int32_t il = 0; il < c->n_layer && rc == ES_OK; il++) {
        char name[64];
        snprintf(name, sizeof name, "blk.%d.ffn_gate_inp.weight", (int) il);
        const es_tensor * t = es_gguf_find_tensor(g, name);
        uint8_t * r = calloc(round_up(t->nbytes, 8), 1);
        if (!r) return ES_ERR_NO_MEMORY;
        memcpy(r, t->data, t->nbytes);
        sum += es_sidecar_checksum(r, round_up(t->nbytes, 8));
        free(r);
    }
    if (rc != ES_OK || sum != rd64(h + 48)) {
        snprintf(err, err_cap, "sidecar %s was made for another model: checksum %016llx of its "
                 "model's metadata and routers, this model's %016llx", path,
                 (unsigned long long) rd64(h + 48), (unsigned long long) sum);
        return ES_ERR_FORMAT;
    }
    c->low_type[ES_EXPERT_GATE] = c->low_type[ES_EXPERT_UP] = (int32_t) rd32(h + 12);
    c->low_type[ES_EXPERT_DOWN] = (int32_t) rd32(h + 72);
    const size_t b = es_act_type(c->low_type[0]) >= 0 ? es_type_row_bytes(c->low_type[0], D) : 0;
    const size_t bf = es_act_type(c->low_type[2]) >= 0 ? es_type_row_bytes(c->low_type[2], F) : 0;
    if (b == 0 || bf == 0) {
        snprintf(err, err_cap, "sidecar %s: types %s (gate, up) and %s (down) do not fit rows of "
                 "%lld and %lld values", path, es_type_name(c->low_type[0]),
                 es_type_name(c->low_type[2]), (long long) D, (long long) F);
        return ES_ERR_FORMAT;
    }
    c->low_slab[ES_EXPERT_GATE] = c->low_slab[ES_EXPERT_UP] = (size_t) F * b;
    c->low_slab[ES_EXPERT_DOWN] = (size_t) D * bf;
    c->low_off[0] = 0;
    c->low_off[1] = c->low_slab[0];
    c->low_off[2] = c->low_slab[0] + c->low_slab[1];
    c->low_stride = round_up(c->low_off[2] + c->low_slab[2], SLOT_ALIGN);
    c->low_data_off = (int64_t) rd64(h + 64);
    const size_t n_copies = (size_t) c->n_layer * (size_t) c->n_expert;
    if (rd64(h + 56) != c->low_stride || c->low_data_off < SIDECAR_HEADER + (int64_t) (8 * n_copies) ||
        (uint64_t) st.st_size < (uint64_t) c->low_data_off + n_copies * c->low_stride) {
        snprintf(err, err_cap, "sidecar %s is truncated or its layout does not fit the model "
                 "(copies of %llu bytes, %llu expected)", path,
                 (unsigned long long) rd64(h + 56), (unsigned long long) c->low_stride);
        return ES_ERR_FORMAT;
    }
    c->low_sum = malloc(n_copies * sizeof *c->low_sum);
    if (!c->low_sum) return ES_ERR_NO_MEMORY;
    if (pread_full(c->low_fd, c->low_sum, n_copies * sizeof *c->low_sum, SIDECAR_HEADER) != ES_OK) {
        snprintf(err, err_cap, "sidecar %s: cannot read its checksums", path);
        return ES_ERR_IO;
    }
    return ES_OK;
}

int es_expert_cache_init(const es_gguf * g, const char * path, const es_experts * ex,
                         const es_model_params * p, es_expert_cache ** out, char * err,
                         size_t err_cap) {
    char scratch[8];
    if (!err || !err_cap) { err = scratch; err_cap = sizeof scratch; }
    if (!g || !path || !ex || !p || !out) return ES_ERR_INVALID_ARG;
    *out = NULL;
    if (p->expert_precision < ES_PRECISION_EXACT || p->expert_precision > ES_PRECISION_FAST ||
        p->expert_policy < ES_POLICY_ADAPTIVE || p->expert_policy > ES_POLICY_LRU ||
        p->prefetch_depth < 0) {
        snprintf(err, err_cap, "bad expert cache parameters: precision %d, policy %d, "
                 "prefetch depth %d", (int) p->expert_precision, (int) p->expert_policy,
                 (int) p->prefetch_depth);
        return ES_ERR_INVALID_ARG;
    }
    if (p->expert_precision != ES_PRECISION_EXACT && !p->expert_sidecar) {
        snprintf(err, err_cap, "expert precision %s needs the low-precision sidecar (edgespec "
                 "moe prepare)", p->expert_precision == ES_PRECISION_FAST ? "fast" : "balanced");
        return ES_ERR_INVALID_ARG;
    }
    const es_moe_params * mp = es_experts_params(ex);
    es_expert_cache * c = calloc(1, sizeof *c);
    if (!c) return ES_ERR_NO_MEMORY;
    c->fd = c->low_fd = -1;
    c->n_layer = mp->n_layer;
    c->n_expert = mp->n_expert;
    c->k = mp->n_expert_used;
    c->precision = p->expert_precision;
    c->policy = p->expert_policy;
    c->max_depth = p->prefetch_depth;
    c->depth = p->prefetch_depth > 0 ? 1 : 0;
    for (int d = 0; d <= ES_PREFETCH_DEPTHS; d++) c->stall_at[d] = -1.0;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->work, NULL);
    pthread_cond_init(&c->done, NULL);
    int rc = ES_OK;
    const size_t n3 = (size_t) c->n_layer * 3;
    c->type = malloc(n3 * sizeof *c->type);
    c->slab = malloc(n3 * sizeof *c->slab);
    c->off = malloc(n3 * sizeof *c->off);
    c->file_off = malloc(n3 * sizeof *c->file_off);
    if (!c->type || !c->slab || !c->off || !c->file_off) rc = ES_ERR_NO_MEMORY;
    // A slot holds any layer's expert: the largest of them.
    size_t expert_bytes = 0;
    for (int32_t il = 0; il < c->n_layer && rc == ES_OK; il++) {
        size_t at = 0;
        for (int w = 0; w < 3; w++) {
            const es_tensor * t = es_experts_tensor(ex, il, w);
            c->type[il * 3 + w] = t->type;
            c->slab[il * 3 + w] = t->nbytes / (size_t) c->n_expert;
            c->off[il * 3 + w] = at;
            c->file_off[il * 3 + w] = es_gguf_tensor_offset(g, t);
            at += c->slab[il * 3 + w];
        }
        expert_bytes = at > expert_bytes ? at : expert_bytes;
    }
    c->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (rc == ES_OK && (c->fd < 0 || fstat(c->fd, &c->st0) != 0)) {
        snprintf(err, err_cap, "cannot open the model for its experts: %s", strerror(errno));
        rc = ES_ERR_IO;
    }
    if (rc == ES_OK && p->expert_sidecar) {
        rc = open_sidecar(c, g, p->expert_sidecar, mp->n_embd, mp->n_ff, err, err_cap);
    }
    // The pools: EXACT full slots only; FAST low-precision ones only (it
    // never reads a full copy); BALANCED a few low slots (BALANCED_LOW_SHARE),
    // the rest (at least one layer's active experts) full.
    const bool fast = c->low_sum && c->precision == ES_PRECISION_FAST;
    const bool balanced = c->low_sum && c->precision == ES_PRECISION_BALANCED;
    int64_t n_full = 0, n_low = 0;
    if (rc == ES_OK) {
        c->slot_bytes = round_up(expert_bytes, SLOT_ALIGN);
        c->low_slot_bytes = c->low_sum ? c->low_stride : 0;
        const int64_t B = p->expert_cache_bytes, full = (int64_t) c->slot_bytes;
        const int64_t low = (int64_t) c->low_slot_bytes, all = (int64_t) c->n_layer * c->n_expert;
        const int64_t min = (fast ? low : full) * c->k;
        if (B < min) {
            snprintf(err, err_cap, "an expert cache of %.2f MB is below the minimum of %.2f MB "
                     "(one layer's %d active experts%s)", (double) B / 1e6,
                     ceil((double) min / 1e4) / 100.0, (int) c->k,
                     fast ? " as low-precision copies" : "");
            rc = ES_ERR_INVALID_ARG;
        } else if (fast) {
            n_low = B / low;
        } else if (balanced) {
            n_low = (int64_t) ((double) B * BALANCED_LOW_SHARE) / low;
            n_low = n_low > 2 * c->k ? n_low : 2 * c->k;
            n_low = n_low < all ? n_low : all;
            n_full = (B - n_low * low) / full;
            if (n_full < c->k) n_full = c->k, n_low = (B - c->k * full) / low;
        } else {
            n_full = B / full;
        }
        n_full = n_full < all ? n_full : all;
        n_low = n_low < all ? n_low : all;
    }
    if (rc == ES_OK) {
        c->n_full = (int32_t) n_full;
        c->n_slots = (int32_t) (n_full + n_low);
        const size_t E = (size_t) c->n_layer * (size_t) c->n_expert;
        const size_t arena = (size_t) n_full * c->slot_bytes + (size_t) n_low * c->low_slot_bytes;
        if (posix_memalign((void **) &c->arena, SLOT_ALIGN, arena)) {
            c->arena = NULL;
        }
        c->slots = calloc((size_t) c->n_slots, sizeof *c->slots);
        c->map[0] = malloc(E * sizeof *c->map[0]);
        c->map[1] = malloc(E * sizeof *c->map[1]);
        c->cur_slot = malloc((size_t) c->n_expert * sizeof *c->cur_slot);
        c->held = malloc((size_t) c->n_slots * sizeof *c->held);
        c->queue = malloc((size_t) c->n_slots * sizeof *c->queue);
        if (!c->arena || !c->slots || !c->map[0] || !c->map[1] || !c->cur_slot || !c->held ||
            !c->queue) {
            rc = ES_ERR_NO_MEMORY;
        }
    }
    if (rc == ES_OK) {
        for (size_t i = 0; i < (size_t) c->n_layer * (size_t) c->n_expert; i++) {
            c->map[0][i] = c->map[1][i] = -1;
        }
        for (int32_t i = 0; i < c->n_slots; i++) {
            c->slots[i].layer = -1;
            c->slots[i].data = c->arena + (i < c->n_full ? (size_t) i * c->slot_bytes
                                          : (size_t) c->n_full * c->slot_bytes +
                                            (size_t) (i - c->n_full) * c->low_slot_bytes);
        }
        c->st.budget_bytes = p->expert_cache_bytes;
        c->st.cache_bytes = (int64_t) c->n_full * (int64_t) c->slot_bytes +
                            (int64_t) (c->n_slots - c->n_full) * (int64_t) c->low_slot_bytes;
        c->st.n_slots = c->n_slots;
        c->provider = (es_expert_provider) {
            .self = c, .get = cache_get, .put = cache_put, .begin = cache_begin,
            .end = cache_end, .prefetch = c->max_depth > 0 ? cache_prefetch : NULL,
            .prefetch_depth = cache_prefetch_depth,
            // A batch's group fits the pool every expert of it may need:
            // FAST's low slots, else the full ones (a low copy finding no
            // low slot free takes a full one).
            .max_held = fast ? c->n_slots : c->n_full,
        };
        if (pthread_create(&c->io, NULL, io_main, c) != 0) rc = ES_ERR_NO_MEMORY;
        else c->io_started = true;
    }
    if (rc != ES_OK) {
        es_expert_cache_free(c);
        return rc;
    }
    *out = c;
    return ES_OK;
}

void es_expert_cache_free(es_expert_cache * c) {
    if (!c) return;
    if (c->io_started) {
        pthread_mutex_lock(&c->mu);
        c->stop = true;
        pthread_cond_broadcast(&c->work);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->io, NULL);
    }
    if (c->fd >= 0) close(c->fd);
    if (c->low_fd >= 0) close(c->low_fd);
    pthread_cond_destroy(&c->done);
    pthread_cond_destroy(&c->work);
    pthread_mutex_destroy(&c->mu);
    free(c->queue);
    free(c->held);
    free(c->cur_slot);
    free(c->map[1]);
    free(c->map[0]);
    free(c->slots);
    free(c->arena);
    free(c->low_sum);
    free(c->file_off);
    free(c->off);
    free(c->slab);
    free(c->type);
    free(c);
}

const es_expert_provider * es_expert_cache_provider(es_expert_cache * c) { return &c->provider; }

void es_expert_cache_stats(es_expert_cache * c, es_expert_stats * out) {
    pthread_mutex_lock(&c->mu);
    *out = c->st;
    out->prefetch_depth = c->depth;
    pthread_mutex_unlock(&c->mu);
}

void es_expert_cache_stats_reset(es_expert_cache * c) {
    pthread_mutex_lock(&c->mu);
    const es_expert_stats keep = c->st;
    memset(&c->st, 0, sizeof c->st);
    c->st.budget_bytes = keep.budget_bytes;
    c->st.cache_bytes = keep.cache_bytes;
    c->st.n_slots = keep.n_slots;
    pthread_mutex_unlock(&c->mu);
}

const char * es_expert_cache_error(es_expert_cache * c) {
    // Written under the mutex by the I/O thread; read once decoding failed.
    pthread_mutex_lock(&c->mu);
    const char * e = c->err;
    pthread_mutex_unlock(&c->mu);
    return e;
}
