package admission

import (
	"container/list"
	"sync"
	"time"
)

// What a Stack learns about binding gates, and how it forgets it. Once a
// gate other than the lead binds the jobs of some subjects, the Stack
// holds their turns that meet (stack_meet.go), which costs about twice
// the calls of the lead's line. So it keeps asking: every probeEvery-th
// held job of those subjects probes, holding the lead's turn first and
// that gate's no earlier than it, and finds that gate not binding if its
// turn was not later than the lead's, or came within the lead's
// tolerance of now (meeting.observe); each next job probes again while
// they find so. After forgetMisses probes in a row, or when the gate has
// not bound for forgetIdle, the subjects'
// jobs go back to the lead's line. The memory holds at most maxLeads
// subject tuples, the least recently used forgotten first.

// maxLeads bounds the subject tuples whose jobs a Stack decides by turns
// that meet; past it, the least recently used is forgotten.
const maxLeads = 4096

// probeEvery is how often (in held jobs of one tuple of subjects) a Stack
// probes whether the gate it learnt to bind them still binds (see above).
const probeEvery = 8

// forgetMisses is how many probes in a row that found their binding gate
// not binding make a Stack forget it (see above).
const forgetMisses = 4

// forgetIdle is how long after the binding gate last bound a job of its
// subjects a Stack forgets it (local clock).
const forgetIdle = time.Minute

// learnt is what a Stack remembers of one tuple of subjects.
type learnt struct {
	key    string    // leadsKey of the subjects
	gate   int       // the gate that binds, held first
	jobs   int       // jobs held since it was learnt
	misses int       // probes in a row that found it not binding
	bound  time.Time // when it last bound (local clock)
}

// leadMemory is a Stack's bounded, least-recently-used memory of the
// gates that bind, by subjects. It is safe for concurrent use.
type leadMemory struct {
	mu    sync.Mutex
	max   int
	order *list.List               // of *learnt, the most recently used first
	byKey map[string]*list.Element // by learnt.key
}

// newLeadMemory returns an empty memory of at most max tuples.
func newLeadMemory(max int) *leadMemory {
	return &leadMemory{max: max, order: list.New(), byKey: map[string]*list.Element{}}
}

// lookup returns the gate that binds the jobs of key's subjects, if one
// does and it bound within forgetIdle of now, and whether this job
// probes whether it still binds: every probeEvery-th, and each while
// some in a row found it not binding.
func (l *leadMemory) lookup(key string, now time.Time) (gate int, probe, ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	e, ok := l.byKey[key]
	if !ok {
		return 0, false, false
	}
	le := e.Value.(*learnt)
	if now.Sub(le.bound) > forgetIdle {
		l.remove(e)
		return 0, false, false
	}
	l.order.MoveToFront(e)
	le.jobs++
	return le.gate, le.misses > 0 || le.jobs%probeEvery == 0, true
}

// has reports whether the memory holds key's subjects, changing nothing.
func (l *leadMemory) has(key string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, ok := l.byKey[key]
	return ok
}

// learn remembers that gate binds the jobs of key's subjects, as of now,
// forgetting the least recently used tuple if the memory is full.
func (l *leadMemory) learn(key string, gate int, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e, ok := l.byKey[key]; ok {
		*e.Value.(*learnt) = learnt{key: key, gate: gate, bound: now}
		l.order.MoveToFront(e)
		return
	}
	if l.order.Len() >= l.max {
		l.remove(l.order.Back())
	}
	l.byKey[key] = l.order.PushFront(&learnt{key: key, gate: gate, bound: now})
}

// observe records whether the gate learnt for key's subjects bound a
// held job (as of now), and forgets it after forgetMisses jobs in a row
// that it did not bind; it reports whether it forgot.
func (l *leadMemory) observe(key string, bound bool, now time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	e, ok := l.byKey[key]
	if !ok {
		return false
	}
	le := e.Value.(*learnt)
	if bound {
		le.misses, le.bound = 0, now
		return false
	}
	if le.misses++; le.misses < forgetMisses {
		return false
	}
	l.remove(e)
	return true
}

// len returns how many tuples of subjects the memory holds.
func (l *leadMemory) len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.order.Len()
}

// remove forgets e; l.mu is held.
func (l *leadMemory) remove(e *list.Element) {
	delete(l.byKey, e.Value.(*learnt).key)
	l.order.Remove(e)
}
