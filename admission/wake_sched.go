package admission

import "time"

// runSchedule is when Run next looks at each shard of the ledger, on the
// process's monotonic clock, from what its looks and the notifications
// told it.
type runSchedule struct {
	tick     time.Duration
	idle     time.Duration // one shard's idle look per idle, in turn
	idleEach time.Duration // so each shard's once per idleEach
	start    time.Time
	shards   []shardSchedule
}

type shardSchedule struct {
	at     time.Time // the next look
	expect bool      // the look at at expects a wake-up due now (the last look said so)
	yield  bool      // left to other processes: a look found nothing it expected
}

// newRunSchedule returns the schedule of n shards, each looked at at once.
// Without notifications (notify false), nothing tells Run of an earlier
// wake-up, so it looks at every shard every Tick.
func newRunSchedule(n int, opts RunOptions, notify bool, now time.Time) *runSchedule {
	s := &runSchedule{tick: opts.Tick, idle: opts.Idle, idleEach: opts.Idle * time.Duration(n), start: now, shards: make([]shardSchedule, n)}
	if !notify {
		s.idle, s.idleEach = opts.Tick, opts.Tick
	}
	for i := range s.shards {
		s.shards[i].at = now
	}
	return s
}

// due returns the shards to look at now.
func (s *runSchedule) due(now time.Time) []int {
	var out []int
	for i, sh := range s.shards {
		if !sh.at.After(now) {
			out = append(out, i)
		}
	}
	return out
}

// next returns when the next look is due.
func (s *runSchedule) next() time.Time {
	at := s.shards[0].at
	for _, sh := range s.shards[1:] {
		if sh.at.Before(at) {
			at = sh.at
		}
	}
	return at
}

// notified records that a process added a wake-up that became shard i's
// first: look there now (to learn when it is due), unless this process
// left the shard to others.
func (s *runSchedule) notified(i int, now time.Time) {
	if sh := &s.shards[i]; !sh.yield {
		sh.at, sh.expect = now, false
	}
}

// looked records a look at shard i that took took wake-ups and found the
// next due in next (-1: none), or failed with err.
func (s *runSchedule) looked(i int, now time.Time, took int, next time.Duration, err error) {
	sh := &s.shards[i]
	switch {
	case err != nil:
		sh.at, sh.expect = now.Add(s.tick), false
	case took == wakeBatch:
		sh.at, sh.expect, sh.yield = now, true, false
	case took > 0:
		sh.yield = false
		s.plan(i, now, next)
	case sh.expect && !sh.yield, sh.yield && next >= 0 && next < s.idle:
		// Another process took what this one expected, and takes the
		// next ones as they come due: leave the shard to it, and look
		// once per Idle in case it stopped.
		sh.at, sh.expect, sh.yield = now.Add(s.idle), false, true
	default:
		sh.yield = false
		s.plan(i, now, next)
	}
}

// plan schedules shard i's next look after one at now that found its next
// wake-up due in next (-1: none): then, but at least a Tick later; if none
// is due before the shard's next idle look, at that look.
func (s *runSchedule) plan(i int, now time.Time, next time.Duration) {
	sh := &s.shards[i]
	sh.at, sh.expect = s.idleLook(i, now), false
	if at := now.Add(max(next, s.tick)); next >= 0 && !at.After(sh.at) {
		sh.at, sh.expect = at, true
	}
}

// idleLook returns the first of shard i's idle looks at least an Idle
// after now: they fall at start + i×Idle + k×Idle×shards, so that the
// shards' idle looks take turns, one per Idle.
func (s *runSchedule) idleLook(i int, now time.Time) time.Time {
	phase := s.start.Add(time.Duration(i) * s.idle)
	earliest := now.Add(s.idle)
	if !phase.Before(earliest) {
		return phase
	}
	k := (earliest.Sub(phase) + s.idleEach - 1) / s.idleEach
	return phase.Add(k * s.idleEach)
}
