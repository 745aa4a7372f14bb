package admission

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// The shards' keys: the first is the key given (the one key of earlier
// versions), the first n are the same whatever the number of shards, and
// three fall one in each third of the slot space, so one on each master of
// a three-master cluster with the slots split evenly; nine, one in each
// ninth.
func TestShardKeys(t *testing.T) {
	if got := crc16("123456789"); got != 0x31c3 {
		t.Fatalf("crc16(123456789) = %#x, want 0x31c3 (CRC-16/XMODEM, as Redis Cluster)", got)
	}
	for _, base := range []string{WakeupsKey, "app:{jobs}", "plain"} {
		nine := shardKeys(base, 9)
		if nine[0] != base {
			t.Errorf("shard 0 of %q is %q, want the key itself", base, nine[0])
		}
		if three := shardKeys(base, 3); !slices.Equal(three, nine[:3]) {
			t.Errorf("%q: 3 shards %v, want the first 3 of 9 %v", base, three, nine[:3])
		}
		for _, n := range []int{3, 9} {
			seen := map[int]string{}
			for _, k := range nine[:n] {
				part := keySlot(k) * n / clusterSlots
				if other, ok := seen[part]; ok {
					t.Errorf("%q: %q (slot %d) and %q (slot %d) in the same 1/%d of the slots", base, k, keySlot(k), other, keySlot(other), n)
				}
				seen[part] = k
			}
		}
	}
}

// Each member is kept in exactly one shard, found there by When and
// counted once by Len; a member a one-key process put in the first shard
// is found there too (an upgrade from one key).
func TestWakeupsShards(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		ctx := context.Background()
		w, err := NewShardedWakeups(rdb, "test:{wakeups}", 3)
		if err != nil {
			t.Fatal(err)
		}
		at := time.Now().Add(time.Hour)
		wakes := map[string]time.Time{}
		for i := range 300 {
			wakes[fmt.Sprintf("m%d", i)] = at
		}
		if err := w.AddAll(ctx, wakes); err != nil {
			t.Fatal(err)
		}
		legacy, _ := NewWakeups(rdb, "test:{wakeups}")
		if err := legacy.Add(ctx, "old", at); err != nil {
			t.Fatal(err)
		}
		total := 0
		for _, k := range w.Keys() {
			members, err := m.ZMembers(k)
			if err != nil {
				t.Fatalf("shard %s: %v", k, err)
			}
			if len(members) < 50 {
				t.Errorf("shard %s holds %d of 301, want about a third", k, len(members))
			}
			total += len(members)
		}
		if n, err := w.Len(ctx); err != nil || n != 301 || total != 301 {
			t.Errorf("Len = %d, %v; members in shards %d; want 301 each", n, err, total)
		}
		for _, member := range []string{"m7", "old"} {
			if got, ok, err := w.When(ctx, member); err != nil || !ok || !got.Equal(time.UnixMicro(at.UnixMicro()).UTC()) {
				t.Errorf("When(%s) = %v, %v, %v, want %v", member, got, ok, err, at)
			}
		}
		if _, ok, err := w.When(ctx, "absent"); ok || err != nil {
			t.Errorf("When(absent) = %v, %v, want not there", ok, err)
		}
		if _, err := NewShardedWakeups(rdb, "k", maxWakeupShards+1); err == nil {
			t.Errorf("NewShardedWakeups with %d shards: no error", maxWakeupShards+1)
		}
	})
}
