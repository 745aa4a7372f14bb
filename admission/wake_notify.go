package admission

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// notice is what a shard's channel said since Run last took it: a set of
// notice bits.
type notice uint32

const (
	// noticeAdded: a wake-up became the shard's first (wake_add.lua).
	noticeAdded notice = 1 << iota
	// noticeReleased: the shard's holder stopped (wake_release.lua).
	noticeReleased
	// noticeTaken: a process took the shard's watch (wake_pop.lua).
	noticeTaken
)

// noticeOf decodes a message of a shard's channel: "released", "taken",
// or else an added wake-up, its time and, if the shard's watch named a
// standby, the standby's ID and how long from the message until the
// wake-up's time (wake_add.lua): in then, for that standby (standby).
func noticeOf(payload string) (what notice, standby string, in time.Duration) {
	switch payload {
	case "released":
		return noticeReleased, "", 0
	case "taken":
		return noticeTaken, "", 0
	}
	f := strings.Fields(payload)
	if len(f) == 3 {
		if us, err := strconv.ParseInt(f[2], 10, 64); err == nil {
			return noticeAdded, f[1], time.Duration(us) * time.Microsecond
		}
	}
	return noticeAdded, "", 0
}

// signals holds, per shard, what its channel said since Run last took it,
// and one pending signal on any for Run's sleep; and, per shard, the
// earliest time of a wake-up added while this process was the standby to
// tell (wake_add.lua), in UnixNano of the local clock (0: none).
type signals struct {
	pending []atomic.Uint32
	due     []atomic.Int64
	any     chan struct{}
}

func (s *signals) take(i int) notice {
	if s.pending == nil {
		return 0
	}
	return notice(s.pending[i].Swap(0))
}

// takeDue returns, and forgets, the earliest time of a wake-up added to
// shard i that this process was told of as its standby (zero if none).
func (s *signals) takeDue(i int) time.Time {
	if s.due == nil {
		return time.Time{}
	}
	if ns := s.due[i].Swap(0); ns != 0 {
		return time.Unix(0, ns)
	}
	return time.Time{}
}

// putDue records a wake-up added to shard i, due at at, for this process
// as its standby: the earliest of those not yet taken.
func (s *signals) putDue(i int, at time.Time) {
	ns := at.UnixNano()
	for {
		cur := s.due[i].Load()
		if cur != 0 && cur <= ns {
			return
		}
		if s.due[i].CompareAndSwap(cur, ns) {
			s.put(i, noticeAdded)
			return
		}
	}
}

func (s *signals) put(i int, what notice) {
	s.pending[i].Or(uint32(what))
	select {
	case s.any <- struct{}{}:
	default: // a signal is pending already
	}
}

// subscribe listens on the channels of every shard (named like its key),
// on which wake_add.lua publishes a wake-up that became the shard's first
// and the watch scripts say who holds the shard. It listens on each both
// as a shard channel (SSUBSCRIBE, Redis 7: the scripts' SPUBLISH) and as a
// plain one (SUBSCRIBE: what a process of an earlier version publishes,
// or a server without shard channels): on a Redis Cluster, in one
// subscription per shard, on that shard's master, so that a fleet's
// subscriptions spread over the masters as its shards do; elsewhere, in
// one subscription. A server without shard channels (before Redis 7) gets
// one plain subscription. stop closes the subscriptions.
//
// If the user may not subscribe (an ACL that grants no channels), it
// reports why and returns ok false: Run must then look at every shard it
// holds every Tick, as nothing will tell it of an earlier wake-up. Other
// errors (Redis unreachable now) are reported and the subscription kept:
// go-redis subscribes again when it reconnects.
func (w *Wakeups) subscribe(ctx context.Context, id string, report func(error)) (sig *signals, stop func(), ok bool) {
	sig = &signals{any: make(chan struct{}, 1)}
	groups := [][]string{w.keys}
	if _, cluster := w.rdb.(*redis.ClusterClient); cluster {
		groups = make([][]string, len(w.keys))
		for i, k := range w.keys {
			groups[i] = []string{k}
		}
	}
	subs, err := w.subscribeGroups(ctx, groups, true)
	if err != nil && strings.Contains(err.Error(), "unknown command") {
		// No shard channels (Redis 6, miniredis): the scripts PUBLISH.
		closeAll(subs)
		subs, err = w.subscribeGroups(ctx, [][]string{w.keys}, false)
	}
	if err != nil && strings.Contains(err.Error(), "NOPERM") {
		closeAll(subs)
		report(fmt.Errorf("admission: wakeups: may not subscribe to %s (grant the user the channels &%s), so looking every tick: %w", w.keys[0], withTagSuffix(w.keys[0], "*"), err))
		return sig, func() {}, false
	}
	if err != nil {
		report(fmt.Errorf("admission: wakeups: subscribing to %s: %w", w.keys[0], err))
	}
	sig.pending = make([]atomic.Uint32, len(w.keys))
	sig.due = make([]atomic.Int64, len(w.keys))
	shard := make(map[string]int, len(w.keys))
	for i, k := range w.keys {
		shard[k] = i
	}
	var done sync.WaitGroup
	for _, sub := range subs {
		done.Go(func() {
			for msg := range sub.Channel(redis.WithChannelHealthCheckInterval(subscriptionCheck)) {
				i, ok := shard[msg.Channel]
				if !ok {
					continue
				}
				what, standby, in := noticeOf(msg.Payload)
				if standby == id {
					sig.putDue(i, time.Now().Add(in))
					continue
				}
				sig.put(i, what)
			}
		})
	}
	return sig, func() {
		for _, sub := range subs {
			if err := sub.Close(); err != nil {
				report(fmt.Errorf("admission: wakeups: closing the subscription: %w", err))
			}
		}
		done.Wait()
	}, true
}

// subscribeGroups subscribes to each group of channels in one subscription,
// as shard channels and plain ones (sharded) or plain ones only, and waits
// for each subscription's first confirmation. It returns the subscriptions
// and the first error.
func (w *Wakeups) subscribeGroups(ctx context.Context, groups [][]string, sharded bool) ([]*redis.PubSub, error) {
	subs := make([]*redis.PubSub, 0, len(groups))
	var errs []error
	for _, g := range groups {
		var sub *redis.PubSub
		if sharded {
			// The shard channels first: a cluster client connects to the
			// master of the first channel's slot.
			sub = w.rdb.SSubscribe(ctx, g...)
			_ = sub.Subscribe(ctx, g...)
		} else {
			sub = w.rdb.Subscribe(ctx, g...)
		}
		rctx, cancel := context.WithTimeout(ctx, subscribeTimeout)
		_, err := sub.Receive(rctx) // the first subscription's confirmation
		cancel()
		subs = append(subs, sub)
		if err != nil {
			errs = append(errs, err)
		}
	}
	return subs, errors.Join(errs...)
}

func closeAll(subs []*redis.PubSub) {
	for _, s := range subs {
		_ = s.Close()
	}
}

// subscribeTimeout bounds waiting for the ledger channels' subscription.
const subscribeTimeout = 5 * time.Second

// subscriptionCheck is how often a quiet subscription is pinged to find a
// dead connection: go-redis's default, 3 s, was a third of an idle
// worker's calls; a connection that dies unnoticed for a minute costs only
// the notifications the idle looks catch up on.
const subscriptionCheck = time.Minute
