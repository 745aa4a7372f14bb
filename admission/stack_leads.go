package admission

import (
	"container/list"
	"strconv"
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
//
// A gate binds by its subject, not by the tuple: a tenant's limit that
// binds the jobs of one of its keys binds those of its other keys too. So
// a tuple not yet learnt whose subject under a gate is one that gate was
// learnt to bind in another tuple (and bound within forgetIdle) is learnt
// at once, at its first job, rather than at the first of its jobs whose
// turns the binding gate holds back past the lead's horizon: by then
// the other keys' jobs have booked the tenant's turns as far ahead as
// their backlog reaches, and this key's jobs, waiting in their line, come
// after all of them, then run alone at their key's limit, not the
// tenant's (measured on virtual time, 3,000 jobs over three keys of 10/s
// within 15/s: 86 % of the tenant's pace in about one run in twenty, the
// key learnt last never learnt). A tuple forgotten by its probes is not
// learnt again this way for forgetIdle: its own jobs found it not bound.

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
	binder string    // binderKey of that gate and the tuple's subject under it
	jobs   int       // jobs held since it was learnt
	misses int       // probes in a row that found it not binding
	bound  time.Time // when it last bound (local clock); when it was forgotten, if off
	off    bool      // forgotten by its probes: not learnt again from its binder until forgetIdle after
}

// binder is what a memory knows of one gate's subject that binds: the
// gate, how many tuples it binds (learnt, not off), and when it last
// bound one.
type binder struct {
	gate   int
	tuples int
	bound  time.Time
}

// binderKey names gate i's subject sub among a memory's binders.
func binderKey(i int, sub string) string {
	return strconv.Itoa(i) + "\x00" + sub
}

// leadMemory is a Stack's bounded, least-recently-used memory of the
// gates that bind, by subjects. It is safe for concurrent use.
type leadMemory struct {
	mu      sync.Mutex
	max     int
	order   *list.List               // of *learnt, the most recently used first
	byKey   map[string]*list.Element // by learnt.key
	binders map[string]*binder       // by binderKey, while it binds a tuple
}

// newLeadMemory returns an empty memory of at most max tuples.
func newLeadMemory(max int) *leadMemory {
	return &leadMemory{max: max, order: list.New(), byKey: map[string]*list.Element{}, binders: map[string]*binder{}}
}

// lookup returns the gate that binds the jobs of key's subjects, if one
// does and it bound within forgetIdle of now, and whether this job
// probes whether it still binds: every probeEvery-th, and each while
// some in a row found it not binding. A tuple not learnt is learnt now
// if one of its binders (binderKey of each gate and its subject, asked of
// binders only then; nil for none) binds another tuple and bound one
// within forgetIdle (see above).
func (l *leadMemory) lookup(key string, binders func() []string, now time.Time) (gate int, probe, ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	e, ok := l.byKey[key]
	if ok && now.Sub(e.Value.(*learnt).bound) > forgetIdle {
		l.remove(e)
		ok = false
	}
	if !ok && binders != nil && len(l.binders) > 0 {
		for _, bk := range binders() {
			if b := l.binders[bk]; b != nil && now.Sub(b.bound) <= forgetIdle {
				l.add(key, b.gate, bk, now)
				return b.gate, false, true
			}
		}
	}
	if !ok {
		return 0, false, false
	}
	le := e.Value.(*learnt)
	if le.off {
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
	e, ok := l.byKey[key]
	return ok && !e.Value.(*learnt).off
}

// learn remembers that gate binds the jobs of key's subjects, as of now,
// binder (binderKey) the gate's subject among them, forgetting the least
// recently used tuple if the memory is full.
func (l *leadMemory) learn(key string, gate int, binder string, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.add(key, gate, binder, now)
}

// add is learn; l.mu is held.
func (l *leadMemory) add(key string, gate int, bk string, now time.Time) {
	le := &learnt{key: key, gate: gate, binder: bk, bound: now}
	if e, ok := l.byKey[key]; ok {
		l.unbind(e.Value.(*learnt))
		e.Value = le
		l.order.MoveToFront(e)
	} else {
		if l.order.Len() >= l.max {
			l.remove(l.order.Back())
		}
		l.byKey[key] = l.order.PushFront(le)
	}
	b := l.binders[bk]
	if b == nil {
		b = &binder{gate: gate}
		l.binders[bk] = b
	}
	b.tuples++
	b.bound = now
}

// unbind takes le from its binder's tuples, if it counts there; l.mu is
// held.
func (l *leadMemory) unbind(le *learnt) {
	if le.off {
		return
	}
	if b := l.binders[le.binder]; b != nil {
		if b.tuples--; b.tuples <= 0 {
			delete(l.binders, le.binder)
		}
	}
}

// observe records whether the gate learnt for key's subjects bound a
// held job (as of now), and forgets it after forgetMisses jobs in a row
// that it did not bind; it reports whether it forgot.
func (l *leadMemory) observe(key string, bound bool, now time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	e, ok := l.byKey[key]
	if !ok || e.Value.(*learnt).off {
		return false
	}
	le := e.Value.(*learnt)
	if bound {
		le.misses, le.bound = 0, now
		if b := l.binders[le.binder]; b != nil {
			b.bound = now
		}
		return false
	}
	if le.misses++; le.misses < forgetMisses {
		return false
	}
	// Kept, off, so that its binder's other tuples do not teach it back
	// (lookup) before forgetIdle.
	l.unbind(le)
	le.off, le.bound = true, now
	return true
}

// len returns how many tuples of subjects the memory holds learnt (not
// those forgotten and kept off).
func (l *leadMemory) len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for e := l.order.Front(); e != nil; e = e.Next() {
		if !e.Value.(*learnt).off {
			n++
		}
	}
	return n
}

// remove forgets e; l.mu is held.
func (l *leadMemory) remove(e *list.Element) {
	le := e.Value.(*learnt)
	l.unbind(le)
	delete(l.byKey, le.key)
	l.order.Remove(e)
}
