//go:build !linux

package main

import "os/exec"

// dieWithParent does nothing here: only Linux kills a child with its
// parent; the fleet part's deferred stops and its signal handler remain.
func dieWithParent(*exec.Cmd) {}
