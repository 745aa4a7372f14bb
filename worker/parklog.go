package worker

import (
	"log/slog"
	"slices"
	"sync"
	"time"
)

// ParkSummaryEvery is how often a Middleware logs, per rule, the tasks it
// parked. Each park is logged at Debug only: a backlog of thousands of
// tasks would otherwise log thousands of Info lines.
const ParkSummaryEvery = 10 * time.Second

// parkTally counts a middleware's parks per rule, in memory (no Redis
// call), and logs one Info line per rule every ParkSummaryEvery while
// tasks park: how many parked in the interval, how many of them in their
// subject's line (no turn booked yet), and the furthest turn booked. An
// interval in which nothing parked logs nothing and runs no timer.
type parkTally struct {
	log   *slog.Logger
	every time.Duration

	mu    sync.Mutex
	rules map[string]*parkCount // this interval's parks, by rule
	timer *time.Timer           // ends the interval; nil while nothing is counted
}

// parkCount is one rule's parks in one interval.
type parkCount struct {
	parked   int
	inLine   int           // of parked: waiting in the subject's line, no turn booked
	furthest time.Time     // the latest turn booked, on the Redis clock; zero if none
	ahead    time.Duration // how far ahead that turn was when booked
}

// add counts a park under rule: booked for turn, ahead of now by ahead,
// or, if turn is zero, in its subject's line.
func (p *parkTally) add(rule string, turn time.Time, ahead time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.rules == nil {
		p.rules = map[string]*parkCount{}
	}
	c := p.rules[rule]
	if c == nil {
		c = &parkCount{}
		p.rules[rule] = c
	}
	c.parked++
	switch {
	case turn.IsZero():
		c.inLine++
	case turn.After(c.furthest):
		c.furthest, c.ahead = turn, ahead
	}
	if p.timer == nil {
		p.timer = time.AfterFunc(p.every, p.flush)
	}
}

// flush logs the interval's lines, by rule name, and ends the interval.
func (p *parkTally) flush() {
	p.mu.Lock()
	counts := p.rules
	p.rules, p.timer = nil, nil
	p.mu.Unlock()
	names := make([]string, 0, len(counts))
	for name := range counts {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		c := counts[name]
		attrs := []any{"rule", name, "parked", c.parked, "interval", p.every}
		if c.inLine > 0 {
			attrs = append(attrs, "in_line", c.inLine)
		}
		if !c.furthest.IsZero() {
			attrs = append(attrs, "furthest_turn", c.furthest.UTC(), "furthest_ahead", c.ahead.Round(time.Millisecond))
		}
		p.log.Info("worker: tasks parked until their turns", attrs...)
	}
}

// stop logs the interval's lines now, if its timer has not done so (Drain).
func (p *parkTally) stop() {
	p.mu.Lock()
	t := p.timer
	p.mu.Unlock()
	if t != nil && t.Stop() {
		p.flush()
	}
}
