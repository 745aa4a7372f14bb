package main

import (
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/jobthrottle/jobthrottle/enqueue"
)

// progress shows how far a batch is: a bar redrawn in place on a terminal,
// else a log line at every tenth of the batch and at most every
// logEvery.
type progress struct {
	w   io.Writer
	tty bool
	log *slog.Logger

	mu       sync.Mutex
	last     enqueue.Enqueued
	seen     bool
	drawn    time.Time
	logged   time.Time
	loggedAt int // tenths logged
}

const (
	redrawEvery = 100 * time.Millisecond
	logEvery    = 5 * time.Second
	barWidth    = 30
)

func newProgress(w io.Writer, tty bool, log *slog.Logger) *progress {
	return &progress{w: w, tty: tty, log: log, logged: time.Now()}
}

// update records an enqueued task (Batch.OnEnqueued).
func (p *progress) update(e enqueue.Enqueued) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.last, p.seen = e, true
	done := e.Index + 1
	now := time.Now()
	if p.tty {
		if done == e.Count || now.Sub(p.drawn) >= redrawEvery {
			p.drawn = now
			fmt.Fprint(p.w, "\r"+bar(e))
		}
		return
	}
	tenth := done * 10 / e.Count
	if tenth > p.loggedAt || now.Sub(p.logged) >= logEvery {
		p.loggedAt, p.logged = tenth, now
		args := []any{"enqueued", done, "of", e.Count}
		if e.Paced {
			args = append(args, "due_in", time.Until(e.Due).Round(time.Millisecond))
		}
		p.log.Info("enqueue: progress", args...)
	}
}

// finish ends the bar's line.
func (p *progress) finish() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.tty && p.seen {
		fmt.Fprint(p.w, "\r"+bar(p.last)+"\n")
	}
}

// bar draws "[=========>      ]  45/100  last due in 2.3s".
func bar(e enqueue.Enqueued) string {
	done := e.Index + 1
	fill := done * barWidth / e.Count
	b := strings.Repeat("=", fill)
	if fill < barWidth {
		b += ">" + strings.Repeat(" ", barWidth-fill-1)
	}
	s := fmt.Sprintf("[%s] %*d/%d", b, len(fmt.Sprint(e.Count)), done, e.Count)
	if e.Paced {
		s += fmt.Sprintf("  last due in %v ", max(time.Until(e.Due), 0).Round(100*time.Millisecond))
	}
	return s
}
