//go:build unix

package main

import (
	"os"
	"sync/atomic"
	"syscall"
	"unsafe"
)

// recorder keeps a process's admission times in a file mapped into memory:
// what it wrote is in the page cache the moment it is written, so the
// parent reads every admission of a child it killed.
type recorder struct {
	buf []int64
	mem []byte
	n   atomic.Int64
}

// openRecorder maps path (created, sized for capacity times) for writing.
func openRecorder(path string, capacity int) (*recorder, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	size := capacity * 8
	if err := f.Truncate(int64(size)); err != nil {
		return nil, err
	}
	mem, err := syscall.Mmap(int(f.Fd()), 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		return nil, err
	}
	return &recorder{buf: unsafe.Slice((*int64)(unsafe.Pointer(&mem[0])), capacity), mem: mem}, nil
}

// add records one admission, ns > 0; past the capacity it is counted only.
func (r *recorder) add(ns int64) {
	if i := r.n.Add(1) - 1; i < int64(len(r.buf)) {
		atomic.StoreInt64(&r.buf[i], ns)
	}
}

// close unmaps the file; what was written stays in it.
func (r *recorder) close() error { return syscall.Munmap(r.mem) }
