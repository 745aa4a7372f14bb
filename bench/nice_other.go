//go:build !linux

package main

import (
	"errors"
	"os/exec"
)

func renice(int) (func(), error) {
	return func() {}, errors.New("bench: -nice is only supported on Linux")
}

func apart(*exec.Cmd, bool) {}
