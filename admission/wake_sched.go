package admission

import (
	"math/rand/v2"
	"time"
)

// runSchedule is when Run next looks at each shard of the ledger, on the
// process's monotonic clock, from what its looks and the notifications
// told it.
//
// One process at a time looks at a shard: the holder of its watch
// (wake_pop.lua), which takes the shard's wake-ups as they come due and
// renews the watch with every look. The others are its standbys: Redis
// gives each the time of its next check of the watch, the fleet's checks
// of one shard a spacing apart (watchTerms), so that a thousand
// processes check a shard as often as a few do. A check after the watch
// has lapsed takes the shard over; a holder that stops releases its
// watches, and the standbys, told on the shard's channel, race for it after
// a random pause, the first to take it telling the others.
//
// A holder is judged alive by the work it does, not only by its watch: a
// check that finds the shard's first wake-up due a grace ago or more takes
// the shard over, and a standby whose next check would come after the
// first wake-up is due plus the grace is told to check then instead (a
// probe, the fleet's probes of a shard a spacing apart). A wake-up added
// after the latest check, and so unknown to the standbys, is told to the
// latest standby to check (the shard's channel names it), which probes
// then too. So a holder killed before a wake-up is replaced a grace after
// that wake-up is due (a spacing more if the shard is so busy that the
// fleet's probes are spaced), not a watch's life later.
type runSchedule struct {
	lead     time.Duration
	tick     time.Duration
	idle     time.Duration // one shard's idle look per idle, in turn
	idleEach time.Duration // so each shard's once per idleEach
	start    time.Time
	shards   []shardSchedule
}

type shardSchedule struct {
	at    time.Time // the next look
	held  bool      // this process holds the shard's watch (its last look said so)
	check time.Time // a standby's next check, as Redis gave it out
	last  time.Time // the last look or check
}

// newRunSchedule returns the schedule of n shards, each looked at at once.
// Without notifications (notify false), nothing tells Run of an earlier
// wake-up, so it looks at every shard it holds every Tick.
func newRunSchedule(n int, opts RunOptions, notify bool, now time.Time) *runSchedule {
	s := &runSchedule{lead: opts.Lead, tick: opts.Tick, idle: opts.Idle, idleEach: opts.Idle * time.Duration(n), start: now, shards: make([]shardSchedule, n)}
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

// held returns the shards whose watches this process holds.
func (s *runSchedule) held() []int {
	var out []int
	for i, sh := range s.shards {
		if sh.held {
			out = append(out, i)
		}
	}
	return out
}

// notified records what the channel of shard i said: a wake-up that
// became its first (the holder looks now, to learn when it is due), the
// watch released (a standby races for it, after a random pause below
// releaseRace so that the fleet does not look at once), or taken (the race
// is over: back to the check Redis gave out).
func (s *runSchedule) notified(i int, what notice, now time.Time) {
	sh := &s.shards[i]
	switch {
	case sh.held && what&noticeAdded != 0:
		sh.at = now
	case sh.held:
	case what&noticeTaken != 0:
		sh.at = sh.check
	case what&noticeReleased != 0:
		if at := now.Add(rand.N(s.releaseRace())); at.Before(sh.at) {
			sh.at = at
		}
	}
}

// released records that this process released shard i's watch for
// another to take: it looks again once the standbys' race is over, and
// takes the shard back only if none took it (a fleet of one).
func (s *runSchedule) released(i int, now time.Time) {
	sh := &s.shards[i]
	sh.held, sh.at = false, now.Add(s.releaseRace()+s.tick)
}

// releaseRace bounds the pause of a standby before it looks at a shard
// whose watch was released.
func (s *runSchedule) releaseRace() time.Duration { return max(s.idle/4, time.Millisecond) }

// probe records that a wake-up of shard i is to be woken at at (local
// clock), told to this process as the shard's standby: unless it holds the
// shard, it checks the shard when that wake-up is overdue by the grace,
// but no sooner than a spacing after its last call on the shard, so that
// a stream of new firsts costs at most one check a spacing.
func (s *runSchedule) probe(i int, at time.Time) {
	sh := &s.shards[i]
	if sh.held {
		return
	}
	_, spacing, _, _ := s.watchTerms()
	p := at.Add(s.grace() - s.lead)
	if floor := sh.last.Add(spacing); p.Before(floor) {
		p = floor
	}
	if p.Before(sh.at) {
		sh.at = p
	}
}

// grace is how long a shard's first wake-up may be overdue before a
// standby takes the shard from its holder (wake_pop.lua): a quarter Idle
// (500 ms with the defaults), and at least two Ticks, as a live holder
// looks once a Tick. A live holder stalled that long loses the shard to a
// standby, which is what the fleet needs of it then.
func (s *runSchedule) grace() time.Duration { return max(s.idle/4, 2*s.tick) }

// looked records a look at shard i: what it took and said (r), or err.
func (s *runSchedule) looked(i int, now time.Time, r lookReply, err error) {
	sh := &s.shards[i]
	sh.last = now
	switch {
	case err != nil:
		sh.at = now.Add(s.tick)
	case !r.held:
		sh.held, sh.check = false, now.Add(r.until)
		sh.at = sh.check
	case len(r.members) == wakeBatch:
		sh.held, sh.at = true, now
	default:
		sh.held = true
		s.plan(i, now, r.next)
	}
}

// plan schedules shard i's next look after one at now that found its next
// wake-up due in next (-1: none): then, but at least a Tick later; if none
// is due before the shard's next idle look, at that look.
func (s *runSchedule) plan(i int, now time.Time, next time.Duration) {
	sh := &s.shards[i]
	sh.at = s.idleLook(i, now)
	if at := now.Add(max(next, s.tick)); next >= 0 && at.Before(sh.at) {
		sh.at = at
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

// watchTerms returns the terms of a shard's watch (wake_pop.lua), from
// Idle, Tick and the number of shards n. The holder's watch lasts until a
// half Idle (slack) after its next look: when the shard's next wake-up is
// due, a Tick at the least, or its idle look, at most Idle × (n + 1) away
// (longest, with the slack). The fleet's standbys check each shard a half
// Idle apart (spacing), each of them no more often than its idle look
// would (least: Idle × n), and at least once per watchCheckMost. A holder
// that stalls or dies while its shard is busy is thus replaced within
// about an Idle of its missed look (2 s with the defaults, in a fleet
// large enough for the checks to come a half Idle apart), an idle one's
// within about Idle × (n + 1.5); meanwhile its shards' jobs come back by
// their queue's own schedule.
func (s *runSchedule) watchTerms() (longest, spacing, least, slack time.Duration) {
	n := time.Duration(len(s.shards))
	return s.idle*(n+1) + s.idle/2, s.idle / 2, s.idle * n, s.idle / 2
}

// watchCheckMost bounds the time from a standby's check of a shard to its
// next: a fleet that shrank without its processes stopping cleanly leaves
// checks given out far ahead to processes that are gone.
const watchCheckMost = 5 * time.Minute
