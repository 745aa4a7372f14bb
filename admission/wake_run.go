package admission

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
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
	// lost it looks at one shard per Idle in turn, so each shard at least
	// once per Idle × shards. If zero, DefaultIdle. An idle process thus
	// costs Redis one look per Idle, however many shards.
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
// Run looks at each shard when its next wake-up is due (at least a Tick
// after its last look there), and at once when a process adds an earlier
// one: it subscribes to the shards' channels, on which Add publishes a
// wake-up that became its shard's first. While nothing is due it looks at
// one shard per Idle. Several processes share the shards: one whose look at
// a shard found nothing it expected (another process took it) leaves that
// shard to the others and looks there only once per Idle until it finds
// something again, so a busy ledger costs about one look per batch of
// wake-ups, not one per process.
func (w *Wakeups) Run(ctx context.Context, opts RunOptions, wake func(ctx context.Context, member string) error) error {
	opts = opts.withDefaults()
	report := func(err error) {
		if opts.OnError != nil && ctx.Err() == nil {
			opts.OnError(err)
		}
	}
	sig, stop, ok := w.subscribe(ctx, report)
	defer stop()
	s := newRunSchedule(len(w.keys), opts, ok, time.Now())
	for ctx.Err() == nil {
		for i := range w.keys {
			if sig.take(i) {
				s.notified(i, time.Now())
			}
		}
		now := time.Now()
		for _, i := range s.due(now) {
			members, next, redisNow, err := w.pop(ctx, w.keys[i], opts.Lead)
			if err != nil {
				report(err)
			}
			w.wakeAll(ctx, members, redisNow, opts, wake, report)
			s.looked(i, time.Now(), len(members), next, err)
		}
		w.sleep(ctx, s.next().Sub(time.Now()), sig.any)
	}
	return nil
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
func (w *Wakeups) wakeAll(ctx context.Context, members []string, redisNow time.Time, opts RunOptions, wake func(ctx context.Context, member string) error, report func(error)) {
	var wg sync.WaitGroup
	sem := make(chan struct{}, wakeParallel)
	for _, m := range members {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			err := wake(ctx, m)
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
}

// sleep waits d, or until ctx ends, or until a process adds a wake-up
// that became its shard's first (from added): Run then looks at once.
func (w *Wakeups) sleep(ctx context.Context, d time.Duration, added <-chan struct{}) {
	if d <= 0 {
		return
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	case <-added:
	}
}

// signals holds, per shard, whether a notification came since Run last
// took it, and one pending signal on any for Run's sleep.
type signals struct {
	pending []atomic.Bool
	any     chan struct{}
}

func (s *signals) take(i int) bool { return s.pending != nil && s.pending[i].Swap(false) }

// subscribe listens, in one subscription, on the channels of every shard
// (named like its key), on which wake_add.lua publishes a wake-up that
// became the shard's first. stop closes the subscription. If the user may
// not subscribe (an ACL that grants no channels), it reports why and
// returns ok false: Run must then look at every shard every Tick, as
// nothing will tell it of an earlier wake-up. Other errors (Redis
// unreachable now) are reported and the subscription kept: go-redis
// subscribes again when it reconnects.
func (w *Wakeups) subscribe(ctx context.Context, report func(error)) (sig *signals, stop func(), ok bool) {
	sig = &signals{any: make(chan struct{}, 1)}
	sub := w.rdb.Subscribe(ctx, w.keys...)
	rctx, cancel := context.WithTimeout(ctx, subscribeTimeout)
	_, err := sub.Receive(rctx) // the first subscription's confirmation
	cancel()
	if err != nil && strings.Contains(err.Error(), "NOPERM") {
		_ = sub.Close()
		report(fmt.Errorf("admission: wakeups: may not subscribe to %s (grant the user the channels &%s), so looking every tick: %w", w.keys[0], withTagSuffix(w.keys[0], "*"), err))
		return sig, func() {}, false
	}
	if err != nil {
		report(fmt.Errorf("admission: wakeups: subscribing to %s: %w", w.keys[0], err))
	}
	sig.pending = make([]atomic.Bool, len(w.keys))
	shard := make(map[string]int, len(w.keys))
	for i, k := range w.keys {
		shard[k] = i
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for msg := range sub.Channel(redis.WithChannelHealthCheckInterval(subscriptionCheck)) {
			if i, ok := shard[msg.Channel]; ok {
				sig.pending[i].Store(true)
			}
			select {
			case sig.any <- struct{}{}:
			default: // a signal is pending already
			}
		}
	}()
	return sig, func() {
		if err := sub.Close(); err != nil {
			report(fmt.Errorf("admission: wakeups: closing the subscription: %w", err))
		}
		<-done
	}, true
}

// subscribeTimeout bounds waiting for the ledger channels' subscription.
const subscribeTimeout = 5 * time.Second

// subscriptionCheck is how often a quiet subscription is pinged to find a
// dead connection: go-redis's default, 3 s, was a third of an idle
// worker's calls; a connection that dies unnoticed for a minute costs only
// the notifications the idle looks catch up on.
const subscriptionCheck = time.Minute

// ErrWakeLater is returned (possibly wrapped) by a wake function that
// could not wake its job yet; Run tries again one Tick later.
var ErrWakeLater = errors.New("admission: wakeups: not ready; try again")

// pop takes the due members of the shard at key and returns them with the
// time until its next is due (-1 if none) and Redis's now.
func (w *Wakeups) pop(ctx context.Context, key string, lead time.Duration) ([]string, time.Duration, time.Time, error) {
	v, err := wakePopScript.Run(ctx, w.rdb, []string{key}, lead.Microseconds(), wakeBatch).Slice()
	if err != nil {
		return nil, -1, time.Time{}, fmt.Errorf("admission: wakeups: take due: %w", err)
	}
	if len(v) != 3 {
		return nil, -1, time.Time{}, fmt.Errorf("admission: wakeups: unexpected reply %v", v)
	}
	raw, _ := v[0].([]any)
	members := make([]string, 0, len(raw))
	for _, m := range raw {
		if s, ok := m.(string); ok {
			members = append(members, s)
		}
	}
	next := time.Duration(-1)
	if us, ok := v[1].(int64); ok && us >= 0 {
		next = time.Duration(us) * time.Microsecond
	}
	now, _ := v[2].(int64)
	return members, next, time.UnixMicro(now), nil
}
