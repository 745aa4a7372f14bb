package main

import (
	"math"
	"slices"
	"time"
)

// percentile returns the p-th percentile (0 ≤ p ≤ 100) of sorted xs by the
// nearest-rank method; 0 for an empty slice.
func percentile(sorted []int64, p float64) int64 {
	if len(sorted) == 0 {
		return 0
	}
	k := int(math.Ceil(p/100*float64(len(sorted)))) - 1
	return sorted[min(max(k, 0), len(sorted)-1)]
}

// maxInWindow returns the most timestamps of sorted ts that fall in any
// half-open window [t, t+w).
func maxInWindow(sorted []int64, w int64) int {
	best, lo := 0, 0
	for hi := range sorted {
		for sorted[hi]-sorted[lo] >= w {
			lo++
		}
		best = max(best, hi-lo+1)
	}
	return best
}

// maxAligned returns the most timestamps in any window [k·w, (k+1)·w) on an
// absolute clock: ts are relative to base (both nanoseconds).
func maxAligned(sorted []int64, base, w int64) int {
	best, run := 0, 0
	var cur int64 = math.MinInt64
	for _, t := range sorted {
		k := floorDiv(base+t, w)
		if k != cur {
			cur, run = k, 0
		}
		run++
		best = max(best, run)
	}
	return best
}

// redisWindows returns the most of sorted Redis times (µs of Redis TIME,
// an absolute clock) in any sliding 1 s and 100 ms window, and in one
// whole second of Redis time.
func redisWindows(sortedUs []int64) (max1s, max100ms, aligned1s int) {
	const sec = int64(time.Second / time.Microsecond)
	return maxInWindow(sortedUs, sec), maxInWindow(sortedUs, sec/10), maxAligned(sortedUs, 0, sec)
}

func floorDiv(a, b int64) int64 {
	q := a / b
	if (a%b != 0) && ((a < 0) != (b < 0)) {
		q--
	}
	return q
}

// countIn counts the timestamps of sorted ts in [lo, hi).
func countIn(sorted []int64, lo, hi int64) int {
	i, _ := slices.BinarySearch(sorted, lo)
	j, _ := slices.BinarySearch(sorted, hi)
	return j - i
}

// jitter returns |gap − ideal| for each gap between consecutive timestamps
// of sorted ts in [lo, hi), sorted.
func jitter(sorted []int64, lo, hi, ideal int64) []int64 {
	var out []int64
	for i := 1; i < len(sorted); i++ {
		if sorted[i-1] < lo || sorted[i] >= hi {
			continue
		}
		d := sorted[i] - sorted[i-1] - ideal
		if d < 0 {
			d = -d
		}
		out = append(out, d)
	}
	slices.Sort(out)
	return out
}

// jain returns Jain's fairness index of xs: (Σx)² / (n·Σx²), 1 when every
// x is equal, 1/n when one takes all. 0 for no data.
func jain(xs []int) float64 {
	var s, s2 float64
	for _, x := range xs {
		s += float64(x)
		s2 += float64(x) * float64(x)
	}
	if s2 == 0 {
		return 0
	}
	return s * s / (float64(len(xs)) * s2)
}

// histogram counts sorted ts in consecutive bins of width w from 0 to end.
func histogram(sorted []int64, w, end int64) []int {
	n := int((end + w - 1) / w)
	out := make([]int, n)
	for _, t := range sorted {
		if t < 0 {
			continue
		}
		if i := int(t / w); i < n {
			out[i]++
		}
	}
	return out
}

func ms(ns int64) float64 { return float64(ns) / float64(time.Millisecond) }
func us(ns int64) float64 { return float64(ns) / float64(time.Microsecond) }
