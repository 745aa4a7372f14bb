//go:build !unix

package main

import (
	"encoding/binary"
	"os"
	"sync/atomic"
)

// recorder keeps a process's admission times in memory and writes them to
// its file on close: without mmap, a killed child's admissions are lost.
type recorder struct {
	buf  []int64
	n    atomic.Int64
	path string
}

func openRecorder(path string, capacity int) (*recorder, error) {
	return &recorder{buf: make([]int64, capacity), path: path}, nil
}

func (r *recorder) add(ns int64) {
	if i := r.n.Add(1) - 1; i < int64(len(r.buf)) {
		atomic.StoreInt64(&r.buf[i], ns)
	}
}

func (r *recorder) close() error {
	b := make([]byte, 8*len(r.buf))
	for i, v := range r.buf {
		binary.LittleEndian.PutUint64(b[8*i:], uint64(v))
	}
	return os.WriteFile(r.path, b, 0o600)
}
