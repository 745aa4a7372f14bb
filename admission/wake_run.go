package admission

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"
)

// RunOptions tunes Run. The zero value uses every default.
type RunOptions struct {
	// Lead is how long before its slot each job is woken. If zero,
	// DefaultLead. Keep it below Options.EarlyWait, so that a job woken on
	// time waits for its turn instead of parking again.
	Lead time.Duration
	// Tick is the shortest Run sleeps between looks at a shard, unless a
	// look took a full batch; also how much later a wake-up that returned
	// ErrWakeLater is tried again. If zero, DefaultTick.
	Tick time.Duration
	// Idle is how often Run looks at the ledger while nothing is due: it
	// sleeps until the next wake-up it knows of is due, or until a process
	// adds an earlier one (Add publishes it); in case a notification was
	// lost it looks at one shard it holds per Idle in turn, so each at
	// least once per Idle × shards, and checks the watch of each shard it
	// does not hold no more often (runSchedule). If zero, DefaultIdle. An
	// idle process thus costs Redis at most one call per Idle, however many
	// shards; a fleet, about one per Idle per shard.
	Idle time.Duration
	// OnError, if set, is called with every error of a look or a wake,
	// possibly from several goroutines at once.
	OnError func(error)
}

// Run wakes due jobs until ctx ends, then returns nil. Each due member is
// taken from the ledger by exactly one process and passed to wake (up to
// 16 at once, so wake must be safe for concurrent use); if wake returns an
// error matching ErrWakeLater, it is put back to be tried again one Tick
// later.
//
// One process at a time looks at each shard: the one holding its watch,
// taken by the first look and renewed by every look after it. The holder
// looks when the shard's next wake-up is due (at least a Tick after its
// last look), at once when a process adds an earlier one (it subscribes to
// the shards' channels, on which Add publishes a wake-up that became its
// shard's first), and, while nothing is due, at one shard per Idle. Every
// other process checks the watch when Redis tells it to, the fleet's
// checks of a shard half an Idle apart, and takes the shard if the watch
// has lapsed or if the shard's first wake-up is overdue by a grace (its
// holder died or stalled with work due): so a fleet of a thousand
// processes looks at a busy ledger about as often as one process does,
// and a holder killed before a wake-up is replaced when that wake-up is
// overdue, not when its watch lapses (runSchedule). When
// ctx ends, Run releases the watches it holds, and another process takes
// each shard at once. A process killed takes nothing more; the wake-ups of
// a look it was killed in, taken from the ledger and not yet woken, come
// back only by their queue's own schedule.
func (w *Wakeups) Run(ctx context.Context, opts RunOptions, wake func(ctx context.Context, member string) error) error {
	opts = opts.withDefaults()
	report := func(err error) {
		if opts.OnError != nil && ctx.Err() == nil {
			opts.OnError(err)
		}
	}
	id := runID()
	sig, stop, ok := w.subscribe(ctx, id, report)
	defer stop()
	s := newRunSchedule(len(w.keys), opts, ok, time.Now())
	for ctx.Err() == nil {
		now := time.Now()
		for i := range w.keys {
			if what := sig.take(i); what != 0 {
				s.notified(i, what, now)
			}
			if at := sig.takeDue(i); !at.IsZero() {
				s.probe(i, at)
			}
		}
		for _, i := range s.due(now) {
			r, err := w.look(ctx, i, id, opts.Lead, s)
			if err != nil {
				report(err)
			}
			passed := w.wakeAll(ctx, r.members, r.now, opts, wake, report)
			s.looked(i, time.Now(), r, err)
			if held := s.held(); len(passed) > 0 {
				passed = slices.DeleteFunc(passed, func(j int) bool { return !slices.Contains(held, j) })
				w.release(ctx, passed, id, report)
				for _, j := range passed {
					s.released(j, time.Now())
				}
			}
		}
		w.sleep(ctx, s.next().Sub(time.Now()), sig.any)
	}
	w.release(context.WithoutCancel(ctx), s.held(), id, opts.OnError)
	return nil
}

// runID returns a random ID for one Run, the holder's name in a watch.
func runID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// release ends the watches of the shards held by the Run with id, so that
// other processes take them at once; a stop that cannot (Redis unreachable,
// the process killed) leaves them to lapse.
func (w *Wakeups) release(ctx context.Context, shards []int, id string, onError func(error)) {
	ctx, cancel := context.WithTimeout(ctx, releaseTimeout)
	defer cancel()
	for _, i := range shards {
		if w.watch(i) == "" {
			continue
		}
		err := wakeReleaseScript.Run(ctx, w.rdb, []string{w.keys[i], w.watch(i)}, id).Err()
		if err != nil && onError != nil {
			onError(fmt.Errorf("admission: wakeups: releasing shard %s; another process takes it when its watch lapses: %w", w.keys[i], err))
		}
	}
}

// releaseTimeout bounds the release of a stopping Run's watches.
const releaseTimeout = 2 * time.Second

// watch returns the key of shard i's watch, or "" if it has none.
func (w *Wakeups) watch(i int) string {
	if i < len(w.watches) {
		return w.watches[i]
	}
	return ""
}

func (o RunOptions) withDefaults() RunOptions {
	if o.Lead <= 0 {
		o.Lead = DefaultLead
	}
	if o.Tick <= 0 {
		o.Tick = DefaultTick
	}
	if o.Idle <= 0 {
		o.Idle = DefaultIdle
	}
	return o
}

// wakeAll passes members to wake, concurrently: at a high rate one look
// takes many jobs, and waking them one round trip after another would
// make the last late for its turn.
// It returns the shards in which a wake put a member back for another
// process (passedOn).
func (w *Wakeups) wakeAll(ctx context.Context, members []string, redisNow time.Time, opts RunOptions, wake func(ctx context.Context, member string) error, report func(error)) (passed []int) {
	var wg sync.WaitGroup
	var mu sync.Mutex
	sem := make(chan struct{}, wakeParallel)
	for _, m := range members {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			err := wake(ctx, m)
			if p, ok := errors.AsType[passedOn](err); ok {
				mu.Lock()
				defer mu.Unlock()
				if i := shardOf(p.member, len(w.keys)); !slices.Contains(passed, i) {
					passed = append(passed, i)
				}
				return
			}
			if errors.Is(err, ErrWakeLater) {
				// Not ready to be woken (still finishing its run,
				// say): one tick later, on the Redis clock.
				err = w.Add(ctx, m, redisNow.Add(opts.Tick+opts.Lead))
			}
			if err != nil {
				report(err)
			}
		}()
	}
	wg.Wait()
	return passed
}

// passedOn is returned by a wake function that put a member back in the
// ledger for another process (Parking: a line whose gate this process has
// not): Run then releases the member's shard, if it holds it, so that
// another process takes the member instead of this one again.
type passedOn struct{ member string }

func (p passedOn) Error() string {
	return fmt.Sprintf("admission: wakeups: %q passed on to another process", p.member)
}

// sleep waits d, or until ctx ends, or until a shard's channel says
// something (from said): Run then looks at what.
func (w *Wakeups) sleep(ctx context.Context, d time.Duration, said <-chan struct{}) {
	if d <= 0 {
		return
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	case <-said:
	}
}

// ErrWakeLater is returned (possibly wrapped) by a wake function that
// could not wake its job yet; Run tries again one Tick later.
var ErrWakeLater = errors.New("admission: wakeups: not ready; try again")

// lookReply is what a look at a shard took and said (wake_pop.lua).
type lookReply struct {
	members []string      // the wake-ups taken
	next    time.Duration // until the shard's next is due; -1 if none
	now     time.Time     // Redis's now
	held    bool          // the caller holds the shard's watch
	until   time.Duration // until the watch ends (held) or the caller's next check
}

// look takes the due members of shard i for the Run with id, if it holds
// the shard's watch or takes it, on the watch terms of s.
func (w *Wakeups) look(ctx context.Context, i int, id string, lead time.Duration, s *runSchedule) (lookReply, error) {
	keys := []string{w.keys[i]}
	args := []any{lead.Microseconds(), wakeBatch}
	if l := w.watch(i); l != "" {
		longest, spacing, least, slack := s.watchTerms()
		keys = append(keys, l)
		args = append(args, id, longest.Microseconds(), spacing.Microseconds(), least.Microseconds(), watchCheckMost.Microseconds(),
			s.tick.Microseconds(), slack.Microseconds(), s.grace().Microseconds())
	}
	v, err := wakePopScript.Run(ctx, w.rdb, keys, args...).Slice()
	if err != nil {
		return lookReply{next: -1}, fmt.Errorf("admission: wakeups: take due: %w", err)
	}
	if len(v) != 5 {
		return lookReply{next: -1}, fmt.Errorf("admission: wakeups: unexpected reply %v", v)
	}
	raw, _ := v[0].([]any)
	r := lookReply{members: make([]string, 0, len(raw)), next: -1}
	for _, m := range raw {
		if s, ok := m.(string); ok {
			r.members = append(r.members, s)
		}
	}
	if us, ok := v[1].(int64); ok && us >= 0 {
		r.next = time.Duration(us) * time.Microsecond
	}
	now, _ := v[2].(int64)
	r.now = time.UnixMicro(now)
	held, _ := v[3].(int64)
	r.held = held == 1
	until, _ := v[4].(int64)
	r.until = time.Duration(until) * time.Microsecond
	return r, nil
}
