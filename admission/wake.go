package admission

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/redis/go-redis/v9"
)

// Wakeups is a ledger of parked jobs to wake at their turns, kept in Redis
// and scored on the Redis clock, shared by every process. A queue that
// schedules in whole seconds (asynq) would bring a job parked until 12.3 s
// back at 13 s, late for its turn, together with every other job of that
// second; a process running Run instead brings each back Lead before its
// turn, so that it waits a moment in place and starts on time.
//
// The ledger is spread over shards, one sorted set each in its own hash
// slot (NewShardedWakeups): each member is kept in exactly one, chosen by a
// hash of the member, so that parking is not bound to one Redis Cluster
// master, and Run serves every shard.
//
// Members are opaque to the ledger: the adapter puts in them what its wake
// function needs (for asynq, the queue and the task ID).
type Wakeups struct {
	rdb     redis.UniversalClient
	keys    []string // the shards' keys; keys[0] is the key given
	watches []string // each shard's watch key, in its slot; "" if none can be
}

var (
	//go:embed lua/wake_add.lua
	wakeAddSrc    string
	wakeAddScript = redis.NewScript(wakeAddSrc)
	//go:embed lua/wake_pop.lua
	wakePopSrc    string
	wakePopScript = redis.NewScript(wakePopSrc)
	//go:embed lua/wake_drop.lua
	wakeDropSrc    string
	wakeDropScript = redis.NewScript(wakeDropSrc)
	//go:embed lua/wake_release.lua
	wakeReleaseSrc    string
	wakeReleaseScript = redis.NewScript(wakeReleaseSrc)
)

// ScriptName returns the name of the wake-up ledger's script whose SHA1 is
// sha (in hex, as EVALSHA sends it): "wake_add", "wake_pop", "wake_drop"
// or "wake_release"; false for any other. As throttle.ScriptName, for
// counting calls by what they do (worker.Metrics.CountRedisCalls).
func ScriptName(sha string) (string, bool) {
	switch sha {
	case wakeAddScript.Hash():
		return "wake_add", true
	case wakePopScript.Hash():
		return "wake_pop", true
	case wakeDropScript.Hash():
		return "wake_drop", true
	case wakeReleaseScript.Hash():
		return "wake_release", true
	}
	return "", false
}

// Defaults of RunOptions.
const (
	// DefaultLead is how long before its turn a parked job is woken.
	DefaultLead = 250 * time.Millisecond
	// DefaultTick is the shortest Run sleeps between two looks at a
	// shard of the ledger while wake-ups come due one after another: each
	// look takes those due within Lead, so a look per Tick keeps them on
	// time.
	DefaultTick = 50 * time.Millisecond
	// DefaultIdle is how often a process waiting for wake-ups looks at
	// a shard of the ledger it holds when nothing is due sooner
	// (RunOptions.Idle). The look only catches what a notification missed
	// (a subscription between reconnections) and renews the watch: the
	// wake-ups a process knows of, and those it is told of, wake it on
	// time. It also sets the watch terms (runSchedule.watchTerms): a
	// holder's watch lasts a half Idle past its next look, and the fleet's
	// standby checks of a shard are half an Idle apart, so a holder that
	// stalls or dies while its shard is busy is replaced within about an
	// Idle of the look it missed.
	DefaultIdle = 2 * time.Second
	// wakeBatch bounds the wake-ups one look takes.
	wakeBatch = 256
	// wakeParallel bounds the wake functions running at once.
	wakeParallel = 16
	// ledgerKeepMs is how long the ledger outlives its latest wake-up.
	ledgerKeepMs = int64(time.Hour / time.Millisecond)
)

// NewWakeups returns the ledger kept at the one key key on rdb, as
// NewShardedWakeups(rdb, key, 1) does.
func NewWakeups(rdb redis.UniversalClient, key string) (*Wakeups, error) {
	return NewShardedWakeups(rdb, key, 1)
}

// NewShardedWakeups returns the ledger kept on rdb in shards keys: key
// itself, and shards-1 keys derived from it, in hash slots spread over the
// slot space (see DefaultWakeupShards). The key and the number of shards
// must be the same in every process that parks or wakes the same jobs; a
// process given more shards than another still reads every key the other
// writes, so raise the number on the workers first. If shards is zero,
// DefaultWakeupShards.
func NewShardedWakeups(rdb redis.UniversalClient, key string, shards int) (*Wakeups, error) {
	if rdb == nil {
		return nil, errors.New("admission: wakeups: nil Redis client")
	}
	if key == "" {
		return nil, errors.New("admission: wakeups: empty key")
	}
	if shards == 0 {
		shards = DefaultWakeupShards
	}
	if shards < 0 || shards > maxWakeupShards {
		return nil, fmt.Errorf("admission: wakeups: %d shards; give 1 to %d (0 for %d)", shards, maxWakeupShards, DefaultWakeupShards)
	}
	keys := shardKeys(key, shards)
	watches := make([]string, len(keys))
	for i, k := range keys {
		watches[i] = watchKey(k)
	}
	return &Wakeups{rdb: rdb, keys: keys, watches: watches}, nil
}

// Keys returns the keys of the ledger's shards, the key it was made with
// first.
func (w *Wakeups) Keys() []string { return slices.Clone(w.keys) }

// keyOf returns the key of the shard that keeps member.
func (w *Wakeups) keyOf(member string) string { return w.keys[shardOf(member, len(w.keys))] }

// addKeys returns the keys wake_add.lua is given for shard i: the shard's,
// and its watch's if it has one (the standby to tell of a new first).
func (w *Wakeups) addKeys(i int) []string {
	if l := w.watch(i); l != "" {
		return []string{w.keys[i], l}
	}
	return []string{w.keys[i]}
}

// Add schedules member to be woken at slot, a time on the Redis clock
// (Decision.Slot). Adding a member again moves it.
func (w *Wakeups) Add(ctx context.Context, member string, slot time.Time) error {
	if err := wakeAddScript.Run(ctx, w.rdb, w.addKeys(shardOf(member, len(w.keys))), member, slot.UnixMicro(), ledgerKeepMs).Err(); err != nil {
		return fmt.Errorf("admission: wakeups: add: %w", err)
	}
	return nil
}

// AddIfAbsent schedules member to be woken at slot, unless it is in the
// ledger already: then it stays where it is.
func (w *Wakeups) AddIfAbsent(ctx context.Context, member string, slot time.Time) error {
	if err := wakeAddScript.Run(ctx, w.rdb, w.addKeys(shardOf(member, len(w.keys))), member, slot.UnixMicro(), ledgerKeepMs, "NX").Err(); err != nil {
		return fmt.Errorf("admission: wakeups: add: %w", err)
	}
	return nil
}

// AddAll schedules each member of wakes to be woken at its time, as Add
// does: one call per shard the members fall in.
func (w *Wakeups) AddAll(ctx context.Context, wakes map[string]time.Time) error {
	byShard := map[int][]any{}
	for m, at := range wakes {
		i := shardOf(m, len(w.keys))
		args := append(byShard[i], m, at.UnixMicro())
		if len(args) == 2 {
			args = append(args, ledgerKeepMs, "")
		}
		byShard[i] = args
	}
	for i, args := range byShard {
		if err := wakeAddScript.Run(ctx, w.rdb, w.addKeys(i), args...).Err(); err != nil {
			return fmt.Errorf("admission: wakeups: add: %w", err)
		}
	}
	return nil
}

// Remove forgets member, if it is in the ledger.
func (w *Wakeups) Remove(ctx context.Context, member string) error {
	if err := w.rdb.ZRem(ctx, w.keyOf(member), member).Err(); err != nil {
		return fmt.Errorf("admission: wakeups: remove: %w", err)
	}
	return nil
}

// removeIfAt forgets member if it is still due at slot, as Add put it:
// not if another process has moved it since.
func (w *Wakeups) removeIfAt(ctx context.Context, member string, slot time.Time) error {
	if err := wakeDropScript.Run(ctx, w.rdb, []string{w.keyOf(member)}, member, slot.UnixMicro()).Err(); err != nil {
		return fmt.Errorf("admission: wakeups: remove: %w", err)
	}
	return nil
}

// When returns when member is to be woken, on the Redis clock, and false
// if it is not in the ledger. A member not in its shard is looked for in
// the first shard too, where a process that kept one key put it.
func (w *Wakeups) When(ctx context.Context, member string) (time.Time, bool, error) {
	keys := []string{w.keyOf(member)}
	if keys[0] != w.keys[0] {
		keys = append(keys, w.keys[0])
	}
	for _, k := range keys {
		us, err := w.rdb.ZScore(ctx, k, member).Result()
		if errors.Is(err, redis.Nil) {
			continue
		}
		if err != nil {
			return time.Time{}, false, fmt.Errorf("admission: wakeups: reading %s: %w", k, err)
		}
		return time.UnixMicro(int64(us)).UTC(), true, nil
	}
	return time.Time{}, false, nil
}

// Len returns how many wake-ups are in the ledger, over every shard.
func (w *Wakeups) Len(ctx context.Context) (int64, error) {
	var n int64
	for _, k := range w.keys {
		c, err := w.rdb.ZCard(ctx, k).Result()
		if err != nil {
			return 0, fmt.Errorf("admission: wakeups: counting %s: %w", k, err)
		}
		n += c
	}
	return n, nil
}
