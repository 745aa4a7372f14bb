package worker

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// lineStale is how long past the next serving it announced a line's
// length counts when this process serves it no more (another process took
// the serving): four servings at the default horizon of 1 s (one every
// half horizon). The fleet's sum may count a line twice for that long,
// or, when a process dies and another takes its lines over (admission
// serves them again 5 s later), miss it until the new one serves it.
const lineStale = 2 * time.Second

// linePruneEvery is how often, at most, recording a serving drops the
// lines whose lengths are stale, so a process nobody scrapes keeps only
// the lines it serves.
const linePruneEvery = time.Second

var lineWaitingDesc = prometheus.NewDesc("jobthrottle_line_waiting",
	"Tasks waiting in the lines of a rule's subjects (no turn booked yet), as the last serving by this process of each line counted them; a line another process serves now drops out a few servings later. Each worker counts the lines it serves: sum over the fleet.",
	[]string{"rule"}, nil)

// lineBook keeps, per rule and subject, how many tasks the last serving
// of the subject's line by this process left waiting in it, in memory (no
// Redis call: the serving's reply carries it), and until when that count
// holds: the next serving it announced plus lineStale. A line left empty
// is dropped; so is one whose count is stale. Subjects are map keys only,
// never labels. It is a prometheus.Collector: the gauge is the sum of a
// rule's counts that hold, 0 for a rule whose lines are all empty.
type lineBook struct {
	mu     sync.Mutex
	rules  map[string]map[string]lineCount // rule -> subject -> count
	pruned time.Time
}

// lineCount is one line's length and until when it holds (local clock).
type lineCount struct {
	waiting int
	until   time.Time
}

// served records a serving of rule's line of subject that left waiting
// tasks in it, to be served again at next (the Redis clock, taken as the
// local one, as the wake-ups take it; zero once the line is empty).
func (b *lineBook) served(rule, subject string, waiting int, next time.Time) {
	now := time.Now()
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.rules == nil {
		b.rules = map[string]map[string]lineCount{}
	}
	lines := b.rules[rule]
	if lines == nil {
		lines = map[string]lineCount{}
		b.rules[rule] = lines
	}
	if now.Sub(b.pruned) >= linePruneEvery {
		b.prune(now)
	}
	if waiting <= 0 {
		delete(lines, subject)
		return
	}
	until := now
	if next.After(now) {
		until = next
	}
	lines[subject] = lineCount{waiting: waiting, until: until.Add(lineStale)}
}

// prune drops the stale counts; b holds its mutex.
func (b *lineBook) prune(now time.Time) {
	b.pruned = now
	for _, lines := range b.rules {
		for subject, c := range lines {
			if now.After(c.until) {
				delete(lines, subject)
			}
		}
	}
}

// waiting returns the tasks waiting in rule's lines now, as last served
// here; 0 for a nil book.
func (b *lineBook) waiting(rule string) int {
	if b == nil {
		return 0
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.prune(time.Now())
	n := 0
	for _, c := range b.rules[rule] {
		n += c.waiting
	}
	return n
}

// Describe sends the book's descriptor.
func (b *lineBook) Describe(ch chan<- *prometheus.Desc) { ch <- lineWaitingDesc }

// Collect sends each rule's tasks waiting in line.
func (b *lineBook) Collect(ch chan<- prometheus.Metric) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.prune(time.Now())
	for rule, lines := range b.rules {
		n := 0
		for _, c := range lines {
			n += c.waiting
		}
		ch <- prometheus.MustNewConstMetric(lineWaitingDesc, prometheus.GaugeValue, float64(n), rule)
	}
}
