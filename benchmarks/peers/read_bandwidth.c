// The host's streaming-read bandwidth, the yardstick of the decode bound (bench_native.py).
//
//   cc -O3 -march=native -fopenmp read_bandwidth.c -o read_bandwidth && ./read_bandwidth THREADS [GIB] [REPEATS]
//
// Why a program of its own: decode at batch 1 reads every weight once per token, so the best a CPU
// engine can do is (bytes read per second) / (bytes per token). torch's `x.sum()` as a probe gave
// 29 GiB/s over 1 GiB and 48 GiB/s over 2 GiB on the same 2-core host (its reduction splits the
// work differently by size), and ik_llama.cpp decoded faster than the "bound" it implied. Here
// THREADS OpenMP threads each read their contiguous share of a GIB GiB buffer (huge pages advised,
// written once beforehand) with eight independent XOR accumulators, which compile to vector loads
// with no dependency chain; the best of REPEATS passes is printed, in GiB/s, alone on one line.
#define _GNU_SOURCE
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s THREADS [GIB=2] [REPEATS=7]\n", argv[0]);
    return 2;
  }
  const int threads = atoi(argv[1]);
  const double gib = argc > 2 ? atof(argv[2]) : 2.0;
  const int repeats = argc > 3 ? atoi(argv[3]) : 7;
  if (threads < 1 || gib <= 0 || repeats < 1) return 2;
  const size_t bytes = (size_t)(gib * (1UL << 30)) & ~((size_t)(1UL << 21) - 1);
  const size_t words = bytes / sizeof(uint64_t);
  uint64_t* buf = aligned_alloc(1UL << 21, bytes);
  if (!buf) {
    perror("aligned_alloc");
    return 1;
  }
  madvise(buf, bytes, MADV_HUGEPAGE);
  omp_set_num_threads(threads);
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < words; ++i) buf[i] = i * 0x9E3779B97F4A7C15ULL;  // each thread faults in its share
  double best = 1e30;
  uint64_t sink = 0;
  for (int r = 0; r < repeats + 1; ++r) {  // one warm-up pass
    const double t0 = now();
    uint64_t total = 0;
#pragma omp parallel reduction(^ : total)
    {
      const int t = omp_get_thread_num(), n = omp_get_num_threads();
      const size_t lo = words / 8 * t / n * 8, hi = words / 8 * (t + 1) / n * 8;
      uint64_t a[8] = {0};
      for (size_t i = lo; i < hi; i += 8)
        for (int j = 0; j < 8; ++j) a[j] ^= buf[i + j];
      for (int j = 0; j < 8; ++j) total ^= a[j];
    }
    const double dt = now() - t0;
    sink ^= total;
    if (r > 0 && dt < best) best = dt;
  }
  printf("%.2f\n", (double)bytes / (1UL << 30) / best);
  fprintf(stderr, "(checksum %llx)\n", (unsigned long long)sink);
  free(buf);
  return 0;
}
