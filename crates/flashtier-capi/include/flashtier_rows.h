/*
 * flashtier row store: exact retrieval of immutable table rows (Engram /
 * embedding rows: 256-byte FP8 weight + 8-byte scale by default) with a
 * set-associative RAM cache, an ownership range and packed shards.
 *
 * No call here makes a CUDA call, so ft_rows_lookup / ft_rows_prefetch /
 * ft_rows_prefetch_start are safe inside a CUDA host-function callback
 * (cudaLaunchHostFunc); ft_rows_prefetch_start with FT_ROWS_FLAG_URING returns
 * without waiting for the drive.
 *
 * Every function returning int returns FT_ROWS_OK or an FT_ROWS_ERR_* code;
 * on error, ft_rows_last_error() describes it (per thread, valid until the
 * next failing call on that thread). No call aborts the process.
 *
 * Threads: lookup, prefetch, prefetch_start and stats may be called
 * concurrently on one store; a prefetch handle may be waited on from any
 * thread. close must not race any other call on that store.
 */
#ifndef FLASHTIER_ROWS_H
#define FLASHTIER_ROWS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FT_ROWS_OK 0
#define FT_ROWS_ERR_INVALID_ARG 1   /* NULL pointer, bad geometry, bad config  */
#define FT_ROWS_ERR_IO 2            /* a read failed (file, offset, length)    */
#define FT_ROWS_ERR_OUT_OF_RANGE 3  /* a row id outside the table, or negative */
#define FT_ROWS_ERR_SHARD 4         /* packed shard mismatched/truncated/corrupt */
#define FT_ROWS_ERR_MEMLOCK 5       /* RAM mode: mmap/mlock refused             */
#define FT_ROWS_ERR_RANGE 6         /* invalid range, or range already fixed    */
#define FT_ROWS_ERR_SOURCE 7        /* table source malformed                   */
#define FT_ROWS_ERR_PANIC 8         /* internal bug caught at the boundary      */

#define FT_ROWS_FLAG_RAM 1u            /* map + mlock the whole table          */
#define FT_ROWS_FLAG_BUFFERED 2u       /* no O_DIRECT                          */
#define FT_ROWS_FLAG_NO_PIN_SCALES 4u  /* do not pin owned scales at set_range */
#define FT_ROWS_FLAG_URING 8u          /* misses through io_uring, 64 in flight
                                          (posix workers where io_uring is
                                          unavailable, said once on stderr)   */

typedef struct ft_rows ft_rows;
typedef struct ft_rows_pending ft_rows_pending;  /* a started prefetch */

typedef struct ft_rows_stats_t {
  uint64_t hits;          /* ids served from the cache (or RAM)       */
  uint64_t misses;        /* distinct rows read from storage          */
  uint64_t reads;         /* read operations issued                   */
  uint64_t deduplicated;  /* batch positions served by another's read */
  uint64_t cache_bytes;
  uint64_t slots;
  uint64_t sets;
  uint64_t ways;
  uint64_t threads;       /* miss-pool threads, caller included       */
  uint64_t scales_bytes;  /* owned scales pinned in RAM               */
  uint64_t lo, hi, rows;  /* owned range and table size               */
  uint32_t packed;        /* 1 when misses read a packed shard        */
  uint32_t ram_mode;
  uint32_t direct;        /* 1 when reads bypass the page cache       */
  uint32_t reserved;
} ft_rows_stats_t;

/* Open a raw table: `rows` weights of `weight_bytes` at `weight_offset` and
 * scales of `scale_bytes` at `scale_offset` (0 and 0 mean 256 and 8). */
int ft_rows_open(const char *path, uint64_t rows, uint64_t weight_offset,
                 uint64_t scale_offset, uint32_t weight_bytes, uint32_t scale_bytes,
                 uint64_t cache_bytes, uint32_t ways, uint32_t flags, ft_rows **out);

/* Open a safetensors tensor (F8_E4M3 [rows, W]) and its scale tensor
 * (F32 [rows, S/4], F64 [rows] or U8 [rows, S]) in a file or checkpoint dir. */
int ft_rows_open_safetensors(const char *model, const char *tensor, const char *scales,
                             uint64_t cache_bytes, uint32_t ways, uint32_t flags,
                             ft_rows **out);

/* Own rows [lo, hi); pins their scales. Fixed afterwards. */
int ft_rows_set_range(ft_rows *store, uint64_t lo, uint64_t hi);

/* Attach this rank's packed shard for `layer`. *attached = 0 when the file
 * is missing (misses keep reading the source); a mismatched, truncated or
 * corrupt shard is FT_ROWS_ERR_SHARD and is never served. */
int ft_rows_attach_packed(ft_rows *store, const char *path, uint64_t layer, int *attached);

/* Fill weights[i * weight_bytes ...] and scales[i * scale_bytes ...] with row
 * ids[i]; rows outside the owned range come back as zeros. The buffers hold
 * count * weight_bytes and count * scale_bytes bytes. On error nothing usable
 * is written. */
int ft_rows_lookup(ft_rows *store, const int64_t *ids, uint64_t count,
                   uint8_t *weights, uint8_t *scales);

/* Warm the cache with the owned rows among ids; returns when cached. */
int ft_rows_prefetch(ft_rows *store, const int64_t *ids, uint64_t count);

/* Start warming the cache with the owned rows among ids and return without
 * waiting for the drive: the next step's rows read while this step looks up
 * its own. With FT_ROWS_FLAG_URING the reads are submitted here (up to 512
 * 4 KiB reads at once; the rest by wait); without it they run here on the
 * miss pool. On success *out is a handle to pass to exactly one of
 * ft_rows_prefetch_wait or ft_rows_prefetch_abandon; it stays valid after
 * ft_rows_close. On error *out is left unchanged. */
int ft_rows_prefetch_start(ft_rows *store, const int64_t *ids, uint64_t count,
                           ft_rows_pending **out);

/* Finish a started prefetch: wait for its reads, verify and cache the rows,
 * free the handle. Returns the first failure (its rows are not cached and a
 * later lookup reads them again). NULL is a no-op returning FT_ROWS_OK. */
int ft_rows_prefetch_wait(ft_rows_pending *pending);

/* Free a started prefetch without waiting: reads in flight complete into
 * buffers the library owns and nothing from them is cached. NULL is a no-op. */
void ft_rows_prefetch_abandon(ft_rows_pending *pending);

int ft_rows_stats(const ft_rows *store, ft_rows_stats_t *out);

/* Close; NULL is a no-op. */
void ft_rows_close(ft_rows *store);

/* The last error on this thread ("" when none). */
const char *ft_rows_last_error(void);

#ifdef __cplusplus
}
#endif
#endif /* FLASHTIER_ROWS_H */
