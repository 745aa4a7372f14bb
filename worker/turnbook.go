package worker

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// turnGrain is the precision of a turnBook: a turn counts as ahead until
// at most turnGrain after it.
const turnGrain = 100 * time.Millisecond

// turnPruneEvery is how often, at most, adding a turn drops the turns
// that have come, so that a process nobody scrapes holds a bucket per
// turnGrain of turns ahead, not one per turn it ever booked.
const turnPruneEvery = time.Second

var (
	bookedTurnsDesc = prometheus.NewDesc("jobthrottle_booked_turns",
		"Turns this process booked for parked tasks that have not come yet (to within 0.1 s), by rule: tasks parked on a booked turn, and the turns it booked serving a subject's line. Tasks still waiting in a line have no turn yet and are not counted. Sum over the fleet.",
		[]string{"rule"}, nil)
	furthestTurnDesc = prometheus.NewDesc("jobthrottle_furthest_turn_seconds",
		"How far ahead of now is the furthest turn this process booked for a parked task, by rule; 0 once it has come. Max over the fleet: how far ahead the rule is booked.",
		[]string{"rule"}, nil)
)

// turnBook counts, per rule, the turns a middleware booked for parked
// tasks that have not come yet, in memory (no Redis call): counts by
// turnGrain of turn time, so a backlog of any size costs one bucket per
// turnGrain booked ahead, and the furthest turn. It is a
// prometheus.Collector; its turns that have come are dropped when it is
// collected, and at most once per turnPruneEvery when a turn is added.
type turnBook struct {
	mu    sync.Mutex
	rules map[string]*ruleTurns
}

// ruleTurns are one rule's turns ahead.
type ruleTurns struct {
	counts   map[int64]int // turns by the end of their grain, in turnGrains since the epoch
	furthest time.Time
	pruned   time.Time
}

// add counts a turn of rule, due at at (local clock).
func (b *turnBook) add(rule string, at time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.rules == nil {
		b.rules = map[string]*ruleTurns{}
	}
	r := b.rules[rule]
	if r == nil {
		r = &ruleTurns{counts: map[int64]int{}}
		b.rules[rule] = r
	}
	now := time.Now()
	if now.Sub(r.pruned) >= turnPruneEvery {
		r.prune(now)
	}
	r.counts[grainEnd(at)]++
	if at.After(r.furthest) {
		r.furthest = at
	}
}

// grainEnd is the end of at's grain, in turnGrains since the epoch.
func grainEnd(at time.Time) int64 {
	g := int64(turnGrain)
	return (at.UnixNano() + g - 1) / g
}

// prune drops the turns that have come by now and returns how many are
// left.
func (r *ruleTurns) prune(now time.Time) int {
	r.pruned = now
	cut, left := now.UnixNano()/int64(turnGrain), 0
	for end, n := range r.counts {
		if end <= cut {
			delete(r.counts, end)
			continue
		}
		left += n
	}
	return left
}

// ahead returns rule's turns that have not come by now: the count of each
// grain, by the grain's last instant, and the furthest turn (zero if
// none). A nil book has none.
func (b *turnBook) ahead(rule string, now time.Time) (map[time.Time]int, time.Time) {
	if b == nil {
		return nil, time.Time{}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	r := b.rules[rule]
	if r == nil || r.prune(now) == 0 {
		return nil, time.Time{}
	}
	grains := make(map[time.Time]int, len(r.counts))
	for end, n := range r.counts {
		grains[time.Unix(0, end*int64(turnGrain)-1)] = n
	}
	return grains, r.furthest
}

// Describe sends the book's descriptors.
func (b *turnBook) Describe(ch chan<- *prometheus.Desc) {
	ch <- bookedTurnsDesc
	ch <- furthestTurnDesc
}

// Collect sends each rule's turns ahead and how far ahead the furthest is.
func (b *turnBook) Collect(ch chan<- prometheus.Metric) {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	for rule, r := range b.rules {
		left := r.prune(now)
		ch <- prometheus.MustNewConstMetric(bookedTurnsDesc, prometheus.GaugeValue, float64(left), rule)
		ch <- prometheus.MustNewConstMetric(furthestTurnDesc, prometheus.GaugeValue, max(r.furthest.Sub(now), 0).Seconds(), rule)
	}
}
