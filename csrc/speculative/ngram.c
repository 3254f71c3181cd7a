/*
 * ngram.c — the n-gram drafting structures: the n-gram index (prompt lookup
 * over the growing text) and the n-gram cache (next-token counts from a
 * corpus or from the session, saved to and loaded from a file).
 *
 * Both hash token n-grams the same way (ngram_hash below) and keep their
 * tables at most half full, so linear probing stays short.
 */
#include "es_common.h"
#include "speculative/es_spec.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------
 * Hashing of token n-grams
 *
 * An n-gram is hashed from its last token backwards, so the hashes of the
 * n-grams ending at one position, n = 1, 2, ..., come one from the other in
 * O(1) each. The length is mixed in last: the same tokens as a 2-gram and
 * as a prefix of a 3-gram never share a key.
 * ------------------------------------------------------------------------ */


// Extends a hash by one token to the left.
static uint64_t hash_step(uint64_t h, es_token t) {
    return (h ^ (uint32_t) t) * ES_FNV_PRIME;
}

// The key of an n-gram from its running hash (murmur3's 64-bit finaliser,
// which spreads FNV's weak low bits over the table index).
static uint64_t hash_key(uint64_t h, int32_t n) {
    h ^= (uint64_t) n * 0x9e3779b97f4a7c15ULL;
    h ^= h >> 33; h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33; h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

// Smallest power of two >= 2 * n (tables stay at most half full), at least 64.
static size_t table_cap_for(size_t n) {
    size_t cap = 64;
    while (cap < 2 * n) cap *= 2;
    return cap;
}

/* ========================================================================
 * N-gram index
 *
 * One open-addressing table for every n in [n_min, n_max], keyed by (n, hash
 * of the n tokens). A slot holds the position right after the most recent
 * occurrence of its n-gram that has a continuation: when token i arrives,
 * the n-grams ending at token i - 1 are (re)inserted with the value i. The
 * current suffix of the text (ending at the last token) is therefore never
 * in the table yet, and a lookup finds an EARLIER occurrence, never itself.
 *
 * Inserting trusts the 64-bit key (O(n_max) per appended token); drafting
 * compares the tokens, so a key collision can cost a match but never
 * propose a continuation of a different n-gram.
 * ======================================================================== */

typedef struct index_slot {
    uint64_t key;  // hash_key() of the n-gram
    int32_t  pos;  // the position after the n-gram; 0: an empty slot (pos >= n >= 1)
    int32_t  n;    // the n-gram's length
} index_slot;

struct es_ngram_index {
    es_ngram_index_params params;
    es_token   * tokens;     // (cap_tokens) the indexed sequence
    int32_t      n_tokens;
    int32_t      cap_tokens;
    index_slot * slots;      // (cap_slots) the table, cap_slots a power of two
    size_t       cap_slots;
    size_t       n_used;     // occupied slots
};

es_ngram_index_params es_ngram_index_default_params(void) {
    es_ngram_index_params p;
    p.n_min = 2;
    p.n_max = 5;
    return p;
}

int es_ngram_index_init(const es_ngram_index_params * params, es_ngram_index ** out) {
    if (!params || !out) return ES_ERR_INVALID_ARG;
    if (params->n_min < 1 || params->n_max < params->n_min || params->n_max > 16) return ES_ERR_INVALID_ARG;
    es_ngram_index * idx = calloc(1, sizeof *idx);
    if (!idx) return ES_ERR_NO_MEMORY;
    idx->params = *params;
    idx->cap_slots = table_cap_for(0);
    idx->slots = calloc(idx->cap_slots, sizeof(index_slot));
    if (!idx->slots) {
        es_ngram_index_free(idx);
        return ES_ERR_NO_MEMORY;
    }
    *out = idx;
    return ES_OK;
}

void es_ngram_index_free(es_ngram_index * idx) {
    if (!idx) return;
    free(idx->slots);
    free(idx->tokens);
    free(idx);
}

void es_ngram_index_reset(es_ngram_index * idx) {
    if (!idx) return;
    memset(idx->slots, 0, idx->cap_slots * sizeof(index_slot));
    idx->n_used = 0;
    idx->n_tokens = 0;
}

int32_t es_ngram_index_size(const es_ngram_index * idx) {
    return idx ? idx->n_tokens : 0;
}

// Inserts or overwrites (key, n) -> pos. The table has room (see reserve).
static void index_put(es_ngram_index * idx, uint64_t key, int32_t n, int32_t pos) {
    const size_t mask = idx->cap_slots - 1;
    for (size_t i = (size_t) key & mask;; i = (i + 1) & mask) {
        index_slot * s = &idx->slots[i];
        if (s->pos == 0) {
            s->key = key; s->n = n; s->pos = pos;
            idx->n_used++;
            return;
        }
        if (s->key == key && s->n == n) {
            s->pos = pos;  // the most recent occurrence wins
            return;
        }
    }
}

// Makes the table big enough to take n_more new keys at most half full.
static int index_reserve(es_ngram_index * idx, size_t n_more) {
    const size_t need = idx->n_used + n_more;
    if (2 * need <= idx->cap_slots) return ES_OK;
    const size_t cap = table_cap_for(need);
    index_slot * slots = calloc(cap, sizeof(index_slot));
    if (!slots) return ES_ERR_NO_MEMORY;
    index_slot * old = idx->slots;
    const size_t old_cap = idx->cap_slots;
    idx->slots = slots;
    idx->cap_slots = cap;
    idx->n_used = 0;
    for (size_t i = 0; i < old_cap; i++) {
        if (old[i].pos != 0) index_put(idx, old[i].key, old[i].n, old[i].pos);
    }
    free(old);
    return ES_OK;
}

int es_ngram_index_append(es_ngram_index * idx, const es_token * tokens, int32_t n_tokens) {
    if (!idx || n_tokens < 0 || (!tokens && n_tokens > 0)) return ES_ERR_INVALID_ARG;
    if (n_tokens > INT32_MAX - idx->n_tokens) return ES_ERR_INVALID_ARG;
    for (int32_t i = 0; i < n_tokens; i++) {
        if (tokens[i] < 0) return ES_ERR_INVALID_ARG;
    }

    // 1. room for the tokens and for every n-gram they can add, before any
    // change: an append either happens whole or not at all.
    const int64_t len = (int64_t) idx->n_tokens + n_tokens;
    if (len > idx->cap_tokens) {
        int64_t cap = idx->cap_tokens > 0 ? idx->cap_tokens : 256;
        while (cap < len) cap *= 2;
        if (cap > INT32_MAX) cap = INT32_MAX;
        es_token * grown = realloc(idx->tokens, sizeof(es_token) * (size_t) cap);
        if (!grown) return ES_ERR_NO_MEMORY;
        idx->tokens = grown;
        idx->cap_tokens = (int32_t) cap;
    }
    const size_t n_sizes = (size_t) (idx->params.n_max - idx->params.n_min + 1);
    const int rc = index_reserve(idx, (size_t) n_tokens * n_sizes);
    if (rc != ES_OK) return rc;

    // 2. each arriving token i gives the n-grams ending at i - 1 a continuation
    es_token * seq = idx->tokens;
    for (int32_t k = 0; k < n_tokens; k++) {
        const int32_t i = idx->n_tokens;
        seq[i] = tokens[k];
        const int32_t n_top = i < idx->params.n_max ? i : idx->params.n_max;
        uint64_t h = ES_FNV_OFFSET;
        for (int32_t n = 1; n <= n_top; n++) {
            h = hash_step(h, seq[i - n]);
            if (n >= idx->params.n_min) index_put(idx, hash_key(h, n), n, i);
        }
        idx->n_tokens = i + 1;
    }
    return ES_OK;
}

// Position after the most recent earlier occurrence of the last n tokens, or 0.
static int32_t index_find(const es_ngram_index * idx, uint64_t key, int32_t n) {
    const es_token * seq = idx->tokens;
    const es_token * suffix = seq + idx->n_tokens - n;
    const size_t mask = idx->cap_slots - 1;
    for (size_t i = (size_t) key & mask;; i = (i + 1) & mask) {
        const index_slot * s = &idx->slots[i];
        if (s->pos == 0) return 0;
        if (s->key == key && s->n == n &&
            memcmp(seq + s->pos - n, suffix, sizeof(es_token) * (size_t) n) == 0) {
            return s->pos;
        }
    }
}

int32_t es_ngram_index_draft(const es_ngram_index * idx, es_token * out, int32_t max_draft,
                             int32_t * match_len) {
    if (match_len) *match_len = 0;
    if (!idx || max_draft < 0 || (!out && max_draft > 0)) return ES_ERR_INVALID_ARG;
    if (max_draft == 0) return 0;

    // Keys of the suffixes, n = 1 .. n_top; an earlier occurrence of an
    // n-gram needs n + 1 tokens of text at least.
    const int32_t len = idx->n_tokens;
    const int32_t n_top = len - 1 < idx->params.n_max ? len - 1 : idx->params.n_max;
    uint64_t keys[17];
    uint64_t h = ES_FNV_OFFSET;
    for (int32_t n = 1; n <= n_top; n++) {
        h = hash_step(h, idx->tokens[len - n]);
        keys[n] = hash_key(h, n);
    }

    // Longest suffix first; copy its continuation up to the end of the text.
    for (int32_t n = n_top; n >= idx->params.n_min; n--) {
        const int32_t pos = index_find(idx, keys[n], n);
        if (pos == 0) continue;
        const int32_t avail = len - pos;  // >= 1: pos was set by a token that arrived
        const int32_t n_out = avail < max_draft ? avail : max_draft;
        memcpy(out, idx->tokens + pos, sizeof(es_token) * (size_t) n_out);
        if (match_len) *match_len = n;
        return n_out;
    }
    return 0;
}

/* ========================================================================
 * N-gram cache
 *
 * Entries live in one dense array, in insertion order (which is also the
 * file order); an open-addressing table of entry indices finds them by
 * (context length, context tokens). Each entry keeps the total count of its
 * context and its most frequent next tokens as a Space-Saving summary
 * (Metwally et al., 2005) of CACHE_TOP slots: a next token that is held is
 * counted, a new one takes a free slot or replaces the least counted slot
 * with that count + 1. Any token more frequent than total / CACHE_TOP is
 * held, the counts of the slots always sum to the total, and a small
 * context (at most CACHE_TOP distinct next tokens) is counted exactly.
 * ======================================================================== */

#define CACHE_MAX_N 8
#define CACHE_TOP   4

typedef struct cache_entry {
    uint64_t key;               // hash_key() of the context
    int32_t  n;                 // context length, [1, n_max]
    uint32_t total;             // times the context was followed by a token (saturates)
    es_token next[CACHE_TOP];   // next tokens; -1: a free slot
    uint32_t count[CACHE_TOP];  // their counts; 0 for a free slot
} cache_entry;

struct es_ngram_cache {
    int32_t       n_max;
    cache_entry * entries;    // (cap_entries)
    es_token    * ctx;        // (cap_entries, n_max) context tokens, the first n of each row used
    size_t        n_entries;
    size_t        cap_entries;
    uint32_t    * slots;      // (cap_slots) entry index + 1; 0: empty
    size_t        cap_slots;  // a power of two
};

int es_ngram_cache_init(int32_t n_max, es_ngram_cache ** out) {
    if (!out || n_max < 1 || n_max > CACHE_MAX_N) return ES_ERR_INVALID_ARG;
    es_ngram_cache * c = calloc(1, sizeof *c);
    if (!c) return ES_ERR_NO_MEMORY;
    c->n_max = n_max;
    c->cap_slots = table_cap_for(0);
    c->slots = calloc(c->cap_slots, sizeof(uint32_t));
    if (!c->slots) {
        es_ngram_cache_free(c);
        return ES_ERR_NO_MEMORY;
    }
    *out = c;
    return ES_OK;
}

void es_ngram_cache_free(es_ngram_cache * c) {
    if (!c) return;
    free(c->slots);
    free(c->ctx);
    free(c->entries);
    free(c);
}

int64_t es_ngram_cache_size(const es_ngram_cache * c) {
    return c ? (int64_t) c->n_entries : 0;
}

// Makes room for n_more new entries: the entry arrays and the slot table.
static int cache_reserve(es_ngram_cache * c, size_t n_more) {
    const size_t need = c->n_entries + n_more;
    if (need >= UINT32_MAX) return ES_ERR_NO_MEMORY;  // slots hold uint32 indices
    if (need > c->cap_entries) {
        size_t cap = c->cap_entries > 0 ? c->cap_entries : 1024;
        while (cap < need) cap *= 2;
        cache_entry * entries = realloc(c->entries, cap * sizeof(cache_entry));
        if (!entries) return ES_ERR_NO_MEMORY;
        c->entries = entries;
        es_token * ctx = realloc(c->ctx, cap * (size_t) c->n_max * sizeof(es_token));
        if (!ctx) return ES_ERR_NO_MEMORY;
        c->ctx = ctx;
        c->cap_entries = cap;
    }
    if (2 * need <= c->cap_slots) return ES_OK;
    const size_t cap = table_cap_for(need);
    uint32_t * slots = calloc(cap, sizeof(uint32_t));
    if (!slots) return ES_ERR_NO_MEMORY;
    const size_t mask = cap - 1;
    for (size_t e = 0; e < c->n_entries; e++) {
        size_t i = (size_t) c->entries[e].key & mask;
        while (slots[i] != 0) i = (i + 1) & mask;
        slots[i] = (uint32_t) e + 1;
    }
    free(c->slots);
    c->slots = slots;
    c->cap_slots = cap;
    return ES_OK;
}

// The slot of context (ctx, n) with key: holding its entry, or the empty slot
// where it would go.
static size_t cache_slot(const es_ngram_cache * c, uint64_t key, const es_token * ctx, int32_t n) {
    const size_t mask = c->cap_slots - 1;
    for (size_t i = (size_t) key & mask;; i = (i + 1) & mask) {
        const uint32_t s = c->slots[i];
        if (s == 0) return i;
        const cache_entry * e = &c->entries[s - 1];
        if (e->key == key && e->n == n &&
            memcmp(c->ctx + (size_t) (s - 1) * (size_t) c->n_max, ctx, sizeof(es_token) * (size_t) n) == 0) {
            return i;
        }
    }
}

// The entry of a context, or NULL.
static const cache_entry * cache_find(const es_ngram_cache * c, uint64_t key, const es_token * ctx, int32_t n) {
    const uint32_t s = c->slots[cache_slot(c, key, ctx, n)];
    return s ? &c->entries[s - 1] : NULL;
}

// Appends a new, empty entry for the context into the empty slot `slot`.
// Room was reserved.
static cache_entry * cache_insert(es_ngram_cache * c, size_t slot, uint64_t key,
                                  const es_token * ctx, int32_t n) {
    const size_t e = c->n_entries++;
    cache_entry * entry = &c->entries[e];
    entry->key = key;
    entry->n = n;
    entry->total = 0;
    for (int j = 0; j < CACHE_TOP; j++) { entry->next[j] = -1; entry->count[j] = 0; }
    es_token * row = c->ctx + e * (size_t) c->n_max;
    memset(row, 0, sizeof(es_token) * (size_t) c->n_max);
    memcpy(row, ctx, sizeof(es_token) * (size_t) n);
    c->slots[slot] = (uint32_t) e + 1;
    return entry;
}

// One more occurrence of `next` after the entry's context (Space-Saving).
static void entry_count(cache_entry * e, es_token next) {
    if (e->total == UINT32_MAX) return;  // saturated: the shares stay as they are
    e->total++;
    int free_slot = -1, least = 0;
    for (int j = 0; j < CACHE_TOP; j++) {
        if (e->next[j] == next) { e->count[j]++; return; }
        if (e->count[j] == 0) { if (free_slot < 0) free_slot = j; }
        else if (e->count[j] < e->count[least]) least = j;
    }
    if (free_slot >= 0) {
        e->next[free_slot] = next;
        e->count[free_slot] = 1;
    } else {
        e->next[least] = next;
        e->count[least]++;
    }
}

int es_ngram_cache_add(es_ngram_cache * c, const es_token * tokens, int32_t n_tokens) {
    if (!c || n_tokens < 0 || (!tokens && n_tokens > 0)) return ES_ERR_INVALID_ARG;
    for (int32_t i = 0; i < n_tokens; i++) {
        if (tokens[i] < 0) return ES_ERR_INVALID_ARG;
    }
    // Each next token i has up to n_max contexts ending at i - 1. Room is
    // reserved in blocks so that memory grows with the distinct contexts,
    // not with the worst case of the whole input (on ES_ERR_NO_MEMORY the
    // blocks before stay counted).
    const int32_t block = 4096;
    for (int32_t b = 1, end; b < n_tokens; b = end) {
        end = n_tokens - b < block ? n_tokens : b + block;
        const int rc = cache_reserve(c, (size_t) (end - b) * (size_t) c->n_max);
        if (rc != ES_OK) return rc;
        for (int32_t i = b; i < end; i++) {
            const int32_t n_top = i < c->n_max ? i : c->n_max;
            uint64_t h = ES_FNV_OFFSET;
            for (int32_t n = 1; n <= n_top; n++) {
                h = hash_step(h, tokens[i - n]);
                const uint64_t key = hash_key(h, n);
                const es_token * ctx = tokens + i - n;
                const size_t slot = cache_slot(c, key, ctx, n);
                const uint32_t s = c->slots[slot];
                cache_entry * e = s ? &c->entries[s - 1] : cache_insert(c, slot, key, ctx, n);
                entry_count(e, tokens[i]);
            }
        }
    }
    return ES_OK;
}

/* ------------------------------------------------------------------------
 * N-gram cache drafting
 * ------------------------------------------------------------------------ */

// The most counted next token of an entry (ties: the lower token id) and
// whether its share of the context's total reaches min_share.
static bool entry_best(const cache_entry * e, float min_share, es_token * best) {
    int b = -1;
    for (int j = 0; j < CACHE_TOP; j++) {
        if (e->count[j] == 0) continue;
        if (b < 0 || e->count[j] > e->count[b] ||
            (e->count[j] == e->count[b] && e->next[j] < e->next[b])) b = j;
    }
    if (b < 0) return false;
    *best = e->next[b];
    return (double) e->count[b] >= (double) min_share * (double) e->total;
}

int32_t es_ngram_cache_draft(const es_ngram_cache * cache, const es_ngram_cache * primary,
                             const es_token * context, int32_t n_context,
                             es_token * out, int32_t max_draft, float min_share) {
    if (!cache || n_context < 0 || (!context && n_context > 0) || max_draft < 0 ||
        (!out && max_draft > 0) || !(min_share >= 0.0f && min_share <= 1.0f)) {
        return ES_ERR_INVALID_ARG;
    }
    const int32_t n_max = primary && primary->n_max > cache->n_max ? primary->n_max : cache->n_max;

    // win: the last n_max tokens of context + draft so far, oldest first.
    es_token win[CACHE_MAX_N];
    int32_t n_win = n_context < n_max ? n_context : n_max;
    for (int32_t i = 0; i < n_win; i++) win[i] = context[n_context - n_win + i];

    int32_t n_out = 0;
    while (n_out < max_draft) {
        // Keys of the window's suffixes, then the longest known context,
        // the primary cache first at each length.
        uint64_t keys[CACHE_MAX_N + 1];
        uint64_t h = ES_FNV_OFFSET;
        for (int32_t n = 1; n <= n_win; n++) {
            h = hash_step(h, win[n_win - n]);
            keys[n] = hash_key(h, n);
        }
        const cache_entry * e = NULL;
        for (int32_t n = n_win; n >= 1 && !e; n--) {
            const es_token * ctx = win + n_win - n;
            if (primary && n <= primary->n_max) e = cache_find(primary, keys[n], ctx, n);
            if (!e && n <= cache->n_max) e = cache_find(cache, keys[n], ctx, n);
        }
        es_token next;
        if (!e || !entry_best(e, min_share, &next)) break;
        out[n_out++] = next;
        if (n_win == n_max) {
            memmove(win, win + 1, sizeof(es_token) * (size_t) (n_win - 1));
            n_win--;
        }
        win[n_win++] = next;
    }
    return n_out;
}

/* ------------------------------------------------------------------------
 * N-gram cache file
 *
 * Little-endian throughout, whatever the machine:
 *   header   "ESNGRAM1" | u32 version (1) | u32 n_max | u64 n_entries
 *   entries  n_entries records of (10 + n_max) u32/i32 words:
 *            n | ctx[n_max] (unused: 0) | total | next[4] (free: -1) | count[4]
 *   trailer  u64 FNV-1a 64 of every byte before it
 * The file length must be exactly that of the header's entry count.
 * ------------------------------------------------------------------------ */

static const char CACHE_MAGIC[8] = {'E', 'S', 'N', 'G', 'R', 'A', 'M', '1'};
#define CACHE_VERSION     1u
#define CACHE_HEADER_SIZE 24
#define CACHE_TRAILER     8

static size_t record_size(int32_t n_max) { return 4 * (size_t) (10 + n_max); }

static void put_u32(unsigned char * p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char) (v >> (8 * i));
}

static void put_u64(unsigned char * p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char) (v >> (8 * i));
}

static uint32_t get_u32(const unsigned char * p) {
    return (uint32_t) p[0] | (uint32_t) p[1] << 8 | (uint32_t) p[2] << 16 | (uint32_t) p[3] << 24;
}

static uint64_t get_u64(const unsigned char * p) {
    return (uint64_t) get_u32(p) | (uint64_t) get_u32(p + 4) << 32;
}

// Writes n bytes and folds them into the checksum.
static bool write_hashed(FILE * f, const unsigned char * p, size_t n, uint64_t * h) {
    *h = es__fnv1a(*h, p, n);
    return fwrite(p, 1, n, f) == n;
}

int es_ngram_cache_save(const es_ngram_cache * c, const char * path) {
    if (!c || !path) return ES_ERR_INVALID_ARG;
    FILE * f = fopen(path, "wb");
    if (!f) return ES_ERR_IO;

    uint64_t h = ES_FNV_OFFSET;
    unsigned char head[CACHE_HEADER_SIZE];
    memcpy(head, CACHE_MAGIC, 8);
    put_u32(head + 8, CACHE_VERSION);
    put_u32(head + 12, (uint32_t) c->n_max);
    put_u64(head + 16, (uint64_t) c->n_entries);
    bool ok = write_hashed(f, head, sizeof head, &h);

    const size_t rec = record_size(c->n_max);
    unsigned char buf[4 * (10 + CACHE_MAX_N)];
    for (size_t e = 0; ok && e < c->n_entries; e++) {
        const cache_entry * entry = &c->entries[e];
        const es_token * ctx = c->ctx + e * (size_t) c->n_max;
        unsigned char * p = buf;
        put_u32(p, (uint32_t) entry->n); p += 4;
        for (int32_t j = 0; j < c->n_max; j++) { put_u32(p, (uint32_t) ctx[j]); p += 4; }
        put_u32(p, entry->total); p += 4;
        for (int j = 0; j < CACHE_TOP; j++) { put_u32(p, (uint32_t) entry->next[j]); p += 4; }
        for (int j = 0; j < CACHE_TOP; j++) { put_u32(p, entry->count[j]); p += 4; }
        ok = write_hashed(f, buf, rec, &h);
    }

    unsigned char tail[CACHE_TRAILER];
    put_u64(tail, h);
    ok = ok && fwrite(tail, 1, sizeof tail, f) == sizeof tail;
    ok = (fclose(f) == 0) && ok;  // fclose flushes: its failure is a write failure
    return ok ? ES_OK : ES_ERR_IO;
}

// Checks one record (rec bytes at p) and adds it to c as a new entry.
static int load_record(es_ngram_cache * c, const unsigned char * p) {
    const int32_t n_max = c->n_max;
    const uint32_t n = get_u32(p);
    if (n < 1 || n > (uint32_t) n_max) return ES_ERR_FORMAT;
    es_token ctx[CACHE_MAX_N];
    for (int32_t j = 0; j < n_max; j++) {
        const int32_t t = (int32_t) get_u32(p + 4 * (1 + j));
        if (j < (int32_t) n ? t < 0 : t != 0) return ES_ERR_FORMAT;
        ctx[j] = t;
    }
    const unsigned char * q = p + 4 * (1 + n_max);
    cache_entry e;
    e.n = (int32_t) n;
    e.total = get_u32(q);
    uint64_t sum = 0;
    for (int j = 0; j < CACHE_TOP; j++) {
        e.next[j] = (int32_t) get_u32(q + 4 * (1 + j));
        e.count[j] = get_u32(q + 4 * (1 + CACHE_TOP + j));
        // a used slot holds a token id, a free one -1 and no count
        if (e.count[j] > 0 ? e.next[j] < 0 : e.next[j] != -1) return ES_ERR_FORMAT;
        for (int i = 0; i < j; i++) {
            if (e.count[j] > 0 && e.next[i] == e.next[j]) return ES_ERR_FORMAT;
        }
        sum += e.count[j];
    }
    if (e.total == 0 || sum != e.total) return ES_ERR_FORMAT;

    uint64_t h = ES_FNV_OFFSET;
    for (int32_t k = 1; k <= (int32_t) n; k++) h = hash_step(h, ctx[n - k]);
    e.key = hash_key(h, (int32_t) n);
    const size_t slot = cache_slot(c, e.key, ctx, (int32_t) n);
    if (c->slots[slot] != 0) return ES_ERR_FORMAT;  // the same context twice
    *cache_insert(c, slot, e.key, ctx, (int32_t) n) = e;
    return ES_OK;
}

// Reads n bytes (all of them, else ES_ERR_IO) and folds them into the checksum.
static int read_hashed(FILE * f, unsigned char * p, size_t n, uint64_t * h) {
    if (fread(p, 1, n, f) != n) return ES_ERR_IO;
    *h = es__fnv1a(*h, p, n);
    return ES_OK;
}

// The body of es_ngram_cache_load: f is open, *out set on ES_OK only.
static int load_file(FILE * f, es_ngram_cache ** out) {
    // 1. the file's length, against which every size below is checked
    if (fseek(f, 0, SEEK_END) != 0) return ES_ERR_IO;
    const long file_len = ftell(f);
    if (file_len < 0 || fseek(f, 0, SEEK_SET) != 0) return ES_ERR_IO;
    if ((unsigned long) file_len < CACHE_HEADER_SIZE + CACHE_TRAILER) return ES_ERR_FORMAT;

    // 2. header
    uint64_t h = ES_FNV_OFFSET;
    unsigned char head[CACHE_HEADER_SIZE];
    int rc = read_hashed(f, head, sizeof head, &h);
    if (rc != ES_OK) return rc;
    if (memcmp(head, CACHE_MAGIC, 8) != 0 || get_u32(head + 8) != CACHE_VERSION) return ES_ERR_FORMAT;
    const uint32_t n_max = get_u32(head + 12);
    if (n_max < 1 || n_max > CACHE_MAX_N) return ES_ERR_FORMAT;
    const uint64_t n_entries = get_u64(head + 16);
    const size_t rec = record_size((int32_t) n_max);
    const uint64_t body = (uint64_t) file_len - CACHE_HEADER_SIZE - CACHE_TRAILER;
    if (n_entries > body / rec || n_entries * rec != body) return ES_ERR_FORMAT;

    // 3. entries, checked one by one (the file length bounds the reservation)
    es_ngram_cache * c = NULL;
    rc = es_ngram_cache_init((int32_t) n_max, &c);
    if (rc == ES_OK) rc = cache_reserve(c, (size_t) n_entries);
    unsigned char buf[4 * (10 + CACHE_MAX_N)];
    for (uint64_t e = 0; rc == ES_OK && e < n_entries; e++) {
        rc = read_hashed(f, buf, rec, &h);
        if (rc == ES_OK) rc = load_record(c, buf);
    }

    // 4. checksum of everything before it
    unsigned char tail[CACHE_TRAILER];
    if (rc == ES_OK && fread(tail, 1, sizeof tail, f) != sizeof tail) rc = ES_ERR_IO;
    if (rc == ES_OK && get_u64(tail) != h) rc = ES_ERR_FORMAT;
    if (rc != ES_OK) {
        es_ngram_cache_free(c);
        return rc;
    }
    *out = c;
    return ES_OK;
}

int es_ngram_cache_load(const char * path, es_ngram_cache ** out) {
    if (!path || !out) return ES_ERR_INVALID_ARG;
    FILE * f = fopen(path, "rb");
    if (!f) return ES_ERR_IO;
    const int rc = load_file(f, out);
    fclose(f);
    return rc;
}
