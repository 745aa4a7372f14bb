package admission

import (
	"fmt"
	"hash/fnv"
	"math"
	"strings"
	"sync"
)

// DefaultWakeupShards is how many keys the wake-up ledger of a fleet is
// spread over (NewShardedWakeups) when a worker or producer is not told
// otherwise. Three, because the smallest Redis Cluster has three masters
// and the three keys are placed in hash slots a third of the slot space
// apart, so that on a cluster whose masters share the slots evenly (as
// redis-cli --cluster create makes them) each master holds one; and on a
// single Redis three keys cost nothing more: a process that waits looks at
// one of them per RunOptions.Idle, and busy it looks at each as its
// wake-ups come due, as it looked at the one key before.
const DefaultWakeupShards = 3

// maxWakeupShards bounds the shards of one ledger.
const maxWakeupShards = 64

// clusterSlots is the number of hash slots of Redis Cluster.
const clusterSlots = 16384

// shardKeys returns the keys of a ledger of n shards at base: shard 0 is
// base itself, so that processes of a version that kept one key (base)
// and processes of this one share it during an upgrade; shard i > 0 is base
// with ":<s>" added to its hash tag (or to its end, if it has none), s the
// smallest number that puts it in the slot vdc3(i) of the slot space after
// base's. The keys of the first n shards are the same whatever n, so a
// process told of more shards than another reads every key the other
// writes.
func shardKeys(base string, n int) []string {
	keys := make([]string, n)
	keys[0] = base
	for i := 1; i < n; i++ {
		keys[i] = shardKey(base, i)
	}
	return keys
}

var shardKeyCache sync.Map // shardKeyID -> string

type shardKeyID struct {
	base string
	i    int
}

// shardKey returns the key of shard i > 0 of the ledger at base.
func shardKey(base string, i int) string {
	if k, ok := shardKeyCache.Load(shardKeyID{base, i}); ok {
		return k.(string)
	}
	target := (keySlot(base) + int(math.Round(vdc3(i)*clusterSlots))) % clusterSlots
	best, bestDist := "", clusterSlots
	// A few tens of thousands of CRC16s of short strings: about a
	// millisecond, once per shard and process.
	for s := 0; s < 16*clusterSlots && bestDist > 0; s++ {
		k := withTagSuffix(base, fmt.Sprintf(":%d", s))
		d := keySlot(k) - target
		if d < 0 {
			d = -d
		}
		if d < bestDist {
			best, bestDist = k, d
		}
	}
	shardKeyCache.Store(shardKeyID{base, i}, best)
	return best
}

// watchKey returns the key of the watch of the shard at key (wake_pop.lua):
// key with ":watch" added, in key's hash slot (for a key without a hash
// tag, key itself becomes the tag), or "" if no such key keeps key's slot
// (a key with braces but no tag, "a{}b"): that shard has no watch, and
// every process looks at it.
func watchKey(key string) string {
	for _, k := range []string{key + ":watch", "{" + key + "}:watch"} {
		if keySlot(k) == keySlot(key) {
			return k
		}
	}
	return ""
}

// vdc3 returns the i-th number of the base-3 van der Corput sequence (0,
// 1/3, 2/3, 1/9, 4/9, 7/9, 2/9, ...): the first 3 (or 9) of them split
// [0, 1) into equal thirds (ninths), whatever the number of shards.
func vdc3(i int) float64 {
	v, denom := 0.0, 1.0
	for ; i > 0; i /= 3 {
		denom *= 3
		v += float64(i%3) / denom
	}
	return v
}

// withTagSuffix adds suffix at the end of key's hash tag (its first
// "{...}" with something inside), or at its end if it has none.
func withTagSuffix(key, suffix string) string {
	if open := strings.IndexByte(key, '{'); open >= 0 {
		if end := strings.IndexByte(key[open+1:], '}'); end > 0 {
			at := open + 1 + end
			return key[:at] + suffix + key[at:]
		}
	}
	return key + suffix
}

// keySlot returns key's Redis Cluster hash slot: CRC16 (XMODEM) of its
// hash tag, or of the whole key if it has none, modulo 16384.
func keySlot(key string) int {
	if open := strings.IndexByte(key, '{'); open >= 0 {
		if end := strings.IndexByte(key[open+1:], '}'); end > 0 {
			key = key[open+1 : open+1+end]
		}
	}
	return int(crc16(key)) % clusterSlots
}

// crc16 is CRC-16/XMODEM (polynomial 0x1021, initial value 0), the
// checksum Redis Cluster hashes keys with.
func crc16(s string) uint16 {
	var crc uint16
	for i := 0; i < len(s); i++ {
		crc ^= uint16(s[i]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc
}

// shardOf returns the shard, of n, that member is kept in: FNV-1a of the
// member modulo n, the same in every process.
func shardOf(member string, n int) int {
	if n <= 1 {
		return 0
	}
	h := fnv.New32a()
	_, _ = h.Write([]byte(member))
	return int(h.Sum32() % uint32(n))
}
