/*
 * Exercises the flashtier row-store C ABI against a naive reference: the raw
 * table file itself, read with stdio.
 *
 * usage: rows_test TABLE ROWS SHARD LAYER LO HI
 *   TABLE: raw table, weights (ROWS x 256) at 0, scales (ROWS x 8) after
 *   SHARD: packed shard of rows [LO, HI) for LAYER
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flashtier_rows.h"

#define W 256
#define S 8

static int failures = 0;

#define CHECK(cond, ...)                                                   \
  do {                                                                     \
    if (!(cond)) {                                                         \
      fprintf(stderr, "rows_test:%d: check failed: %s: ", __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                        \
      fprintf(stderr, " (last error: %s)\n", ft_rows_last_error());        \
      failures++;                                                          \
    }                                                                      \
  } while (0)

static uint8_t *table;
static uint64_t rows, lo, hi;

static void expect_row(int64_t id, const uint8_t *w, const uint8_t *s) {
  static const uint8_t zeros[W] = {0};
  if ((uint64_t)id < lo || (uint64_t)id >= hi) {
    CHECK(memcmp(w, zeros, W) == 0 && memcmp(s, zeros, S) == 0, "row %" PRId64 " not zero", id);
    return;
  }
  CHECK(memcmp(w, table + (uint64_t)id * W, W) == 0, "weights of row %" PRId64, id);
  CHECK(memcmp(s, table + rows * W + (uint64_t)id * S, S) == 0, "scales of row %" PRId64, id);
}

static void lookup_batch(ft_rows *st, const int64_t *ids, uint64_t n) {
  uint8_t *w = malloc(n * W), *s = malloc(n * S);
  CHECK(w && s, "malloc");
  int rc = ft_rows_lookup(st, ids, n, w, s);
  CHECK(rc == FT_ROWS_OK, "lookup rc %d", rc);
  if (rc == FT_ROWS_OK)
    for (uint64_t i = 0; i < n; i++) expect_row(ids[i], w + i * W, s + i * S);
  free(w);
  free(s);
}

static void random_batches(ft_rows *st, unsigned seed) {
  srand(seed);
  for (int round = 0; round < 30; round++) {
    uint64_t n = 1 + (uint64_t)(rand() % 200);
    int64_t *ids = malloc(n * sizeof *ids);
    for (uint64_t i = 0; i < n; i++)
      ids[i] = (i % 3 == 2) ? ids[i - 1] : (int64_t)((uint64_t)rand() % rows);  /* duplicates */
    lookup_batch(st, ids, n);
    free(ids);
  }
}

/* One thread, Engram's order: start the next batch's prefetch, finish this
 * batch's, look it up (all hits), on an io_uring store with the shard. */
static void look_ahead(const char *path, const char *shard, uint64_t layer) {
  ft_rows *st = NULL;
  int rc = ft_rows_open(path, rows, 0, rows * W, 0, 0, 4 << 20, 4, FT_ROWS_FLAG_URING, &st);
  CHECK(rc == FT_ROWS_OK && st, "open with FT_ROWS_FLAG_URING rc %d", rc);
  if (!st) return;
  int attached = 0;
  CHECK(ft_rows_set_range(st, lo, hi) == FT_ROWS_OK, "set range");
  CHECK(ft_rows_attach_packed(st, shard, layer, &attached) == FT_ROWS_OK && attached == 1, "attach");
  enum { N = 144, STEPS = 10 };
  int64_t batches[STEPS + 1][N];
  srand(7);
  for (int b = 0; b <= STEPS; b++)
    for (int i = 0; i < N; i++) batches[b][i] = (int64_t)((uint64_t)rand() % rows);
  ft_rows_pending *ahead = NULL, *next = NULL;
  CHECK(ft_rows_prefetch_start(st, batches[0], N, &ahead) == FT_ROWS_OK && ahead, "start");
  for (int b = 0; b < STEPS; b++) {
    next = NULL;
    CHECK(ft_rows_prefetch_start(st, batches[b + 1], N, &next) == FT_ROWS_OK && next, "start %d", b + 1);
    CHECK(ft_rows_prefetch_wait(ahead) == FT_ROWS_OK, "wait %d", b);
    ft_rows_stats_t before, after;
    CHECK(ft_rows_stats(st, &before) == FT_ROWS_OK, "stats");
    lookup_batch(st, batches[b], N);
    CHECK(ft_rows_stats(st, &after) == FT_ROWS_OK, "stats");
    CHECK(after.misses == before.misses, "step %d: the waited prefetch left %" PRIu64 " misses", b,
          after.misses - before.misses);
    ahead = next;
  }
  ft_rows_prefetch_abandon(ahead);       /* the last one: not needed */
  ft_rows_prefetch_abandon(NULL);
  CHECK(ft_rows_prefetch_wait(NULL) == FT_ROWS_OK, "wait(NULL)");
  ft_rows_pending *untouched = (ft_rows_pending *)&attached;
  int64_t bad[2] = {1, (int64_t)rows};
  CHECK(ft_rows_prefetch_start(st, bad, 2, &untouched) == FT_ROWS_ERR_OUT_OF_RANGE, "bad id");
  CHECK(untouched == (ft_rows_pending *)&attached, "a failed start leaves *out");
  CHECK(ft_rows_prefetch_start(st, bad, 1, NULL) == FT_ROWS_ERR_INVALID_ARG, "NULL out");
  /* A handle outlives its store. */
  CHECK(ft_rows_prefetch_start(st, batches[STEPS], N, &ahead) == FT_ROWS_OK, "start before close");
  ft_rows_close(st);
  CHECK(ft_rows_prefetch_wait(ahead) == FT_ROWS_OK, "wait after close");
}

int main(int argc, char **argv) {
  if (argc != 7) {
    fprintf(stderr, "usage: rows_test TABLE ROWS SHARD LAYER LO HI\n");
    return 2;
  }
  const char *path = argv[1], *shard = argv[3];
  rows = strtoull(argv[2], NULL, 10);
  uint64_t layer = strtoull(argv[4], NULL, 10);
  lo = strtoull(argv[5], NULL, 10);
  hi = strtoull(argv[6], NULL, 10);

  table = malloc(rows * (W + S));
  FILE *f = fopen(path, "rb");
  CHECK(f && fread(table, 1, rows * (W + S), f) == rows * (W + S), "read table");
  if (f) fclose(f);

  ft_rows *st = NULL;
  CHECK(ft_rows_open("/nonexistent/table", rows, 0, rows * W, 0, 0, 1 << 20, 4, 0, &st) != FT_ROWS_OK,
        "open of a missing file must fail");
  CHECK(strlen(ft_rows_last_error()) > 0, "missing-file error has a message");
  CHECK(ft_rows_open(path, rows, 0, rows * W, 0, 0, 1 << 20, 4, 0, NULL) == FT_ROWS_ERR_INVALID_ARG, "NULL out");

  int rc = ft_rows_open(path, rows, 0, rows * W, 0, 0, 1 << 20, 4, 0, &st);
  CHECK(rc == FT_ROWS_OK && st, "open rc %d", rc);
  if (!st) return 1;

  lo = 0; hi = rows;
  random_batches(st, 1);                          /* whole table, scales unpinned */
  lo = strtoull(argv[5], NULL, 10);
  hi = strtoull(argv[6], NULL, 10);
  CHECK(ft_rows_set_range(st, lo, hi) == FT_ROWS_OK, "set range");
  CHECK(ft_rows_set_range(st, 0, rows) == FT_ROWS_ERR_RANGE, "range is fixed once scales are pinned");
  random_batches(st, 2);

  int attached = -1;
  CHECK(ft_rows_attach_packed(st, "/nonexistent/shard.rows", layer, &attached) == FT_ROWS_OK && attached == 0,
        "missing shard falls back (attached=%d)", attached);
  CHECK(ft_rows_attach_packed(st, shard, layer + 1, &attached) == FT_ROWS_ERR_SHARD, "wrong layer refused");
  CHECK(strstr(ft_rows_last_error(), "layer") != NULL, "message names the field: %s", ft_rows_last_error());
  CHECK(ft_rows_attach_packed(st, shard, layer, &attached) == FT_ROWS_OK && attached == 1, "attach");
  random_batches(st, 3);

  /* Out of range and negative ids: an error naming the id. */
  int64_t bad[3] = {1, (int64_t)rows + 9, 2};
  uint8_t w[3 * W], s[3 * S];
  CHECK(ft_rows_lookup(st, bad, 3, w, s) == FT_ROWS_ERR_OUT_OF_RANGE, "out of range");
  char want[64];
  snprintf(want, sizeof want, "%" PRIu64, rows + 9);
  CHECK(strstr(ft_rows_last_error(), want) != NULL, "message names the id: %s", ft_rows_last_error());
  bad[1] = -4;
  CHECK(ft_rows_lookup(st, bad, 3, w, s) == FT_ROWS_ERR_OUT_OF_RANGE, "negative id");
  CHECK(ft_rows_lookup(st, NULL, 3, w, s) == FT_ROWS_ERR_INVALID_ARG, "NULL ids");
  CHECK(ft_rows_lookup(st, NULL, 0, NULL, NULL) == FT_ROWS_OK, "empty batch");

  /* Prefetch then lookup: all hits. */
  int64_t warm[4] = {(int64_t)lo, (int64_t)lo + 1, (int64_t)hi - 1, (int64_t)lo + 1};
  CHECK(ft_rows_prefetch(st, warm, 4) == FT_ROWS_OK, "prefetch");
  ft_rows_stats_t before, after;
  CHECK(ft_rows_stats(st, &before) == FT_ROWS_OK, "stats");
  lookup_batch(st, warm, 4);
  CHECK(ft_rows_stats(st, &after) == FT_ROWS_OK, "stats");
  CHECK(after.hits == before.hits + 4 && after.misses == before.misses, "prefetched rows hit");
  CHECK(after.packed == 1 && after.ways == 4 && after.lo == lo && after.hi == hi && after.rows == rows,
        "stats geometry");
  CHECK(ft_rows_stats(NULL, &after) == FT_ROWS_ERR_INVALID_ARG, "NULL store");
  printf("stats: hits=%" PRIu64 " misses=%" PRIu64 " reads=%" PRIu64 " dedup=%" PRIu64
         " slots=%" PRIu64 " threads=%" PRIu64 " direct=%u\n",
         after.hits, after.misses, after.reads, after.deduplicated, after.slots, after.threads, after.direct);

  ft_rows_close(st);
  ft_rows_close(NULL);

  look_ahead(path, shard, layer);
  free(table);
  if (failures) {
    fprintf(stderr, "rows_test: %d checks failed\n", failures);
    return 1;
  }
  printf("rows_test: ok\n");
  return 0;
}
