package reliability

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// hostileSubjects are subjects that could break a key if they reached it
// raw: hash-tag braces, separators, control bytes, invalid UTF-8, glob
// characters, percent signs that look like the encoding, and the longest
// subject allowed.
var hostileSubjects = []string{
	"{", "}", "{}", "}{", "{a}", "a{b}c", "{{x}}", "x}:rule",
	":", "a:b", "::", "%", "%7B", "%7b", "A", "%41", "%2541",
	"\x00", "a\x00b", "\n", "a\r\nb", "\t", " ", "  ",
	"\xff", "\xc3\x28", "\xed\xa0\x80", "日本語", "emoji 🚦",
	"*", "?", "[a-z]", "\\", "\"quoted\"", "'", "$(rm -rf)", "!pause", "r!cancelled",
	strings.Repeat("}", 1024),
	strings.Repeat("\xff", 1024),
}

// TestHostileSubjects sends every hostile subject through a three-rule
// policy (one cluster slot per subject, three keys per call), a pause and
// a refund, on every backend: miniredis, and in CI the shared Redis and the
// Redis Cluster. Each must be admitted without a Redis error (no CROSSSLOT
// on the cluster), get keys of its own (a 1-per-hour rule admits each
// subject once: two subjects sharing a key would be denied), keys that start
// with the prefix and hold exactly one hash tag, and every key of one
// subject in one slot. Empty and over-long subjects (up to 1 MB) fail at
// once with ErrInvalidSubject, before any Redis call.
func TestHostileSubjects(t *testing.T) {
	for _, b := range redistest.Backends(t) {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			prefix := redistest.Prefix(t)
			lim, err := throttle.New(b.Client, throttle.Options{Prefix: prefix},
				throttle.Rule{Name: "hour", Algorithm: throttle.FixedWindow, Limit: throttle.Limit{Count: 1, Period: time.Hour}},
				throttle.Rule{Name: "{rule}", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 5, Period: time.Hour, Burst: 5}},
				throttle.Rule{Name: "log", Algorithm: throttle.SlidingLog, Limit: throttle.Limit{Count: 5, Period: time.Hour, Burst: 5}},
			)
			if err != nil {
				t.Fatal(err)
			}
			bucket, err := throttle.New(b.Client, throttle.Options{Prefix: prefix},
				throttle.Rule{Name: "tb", Algorithm: throttle.TokenBucket, Limit: throttle.Limit{Count: 5, Period: time.Hour, Burst: 5}},
				throttle.Rule{Name: "gcra", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 5, Period: time.Hour, Burst: 5}},
			)
			if err != nil {
				t.Fatal(err)
			}
			seen := map[string]bool{}
			for _, s := range hostileSubjects {
				if seen[s] {
					t.Fatalf("duplicate test subject %q", s)
				}
				seen[s] = true
				res, err := lim.Allow(ctx, s)
				if err != nil {
					t.Fatalf("Allow(%q) = %v; want no error", trunc(s), err)
				}
				if !res.Allowed {
					t.Errorf("Allow(%q) denied the subject's first request: it shares a key with another subject", trunc(s))
				}
				if res, err := lim.Allow(ctx, s); err != nil || res.Allowed {
					t.Errorf("second Allow(%q) = %+v, %v; want denied by the 1-per-hour rule", trunc(s), res, err)
				}
				r, err := bucket.ReserveN(ctx, s, 1)
				if err != nil {
					t.Fatalf("Reserve(%q) = %v", trunc(s), err)
				}
				if err := r.Cancel(ctx); err != nil {
					t.Fatalf("Cancel (refund, %d keys) of %q = %v", 2+1+2, trunc(s), err)
				}
				if _, err := bucket.PauseFor(ctx, s, time.Millisecond); err != nil {
					t.Fatalf("PauseFor(%q) = %v", trunc(s), err)
				}
				if _, err := bucket.PauseFor(ctx, s, 0); err != nil {
					t.Fatalf("Paused(%q) = %v", trunc(s), err)
				}
			}

			keys := scanKeys(t, b.Client, prefix)
			slots := map[string]int64{} // hash tag -> slot
			tags := map[string]bool{}
			for _, k := range keys {
				if !strings.HasPrefix(k, prefix) {
					t.Errorf("key %q does not start with the prefix", trunc(k))
				}
				rest := k[len(prefix):]
				if strings.Count(rest, "{") != 1 || strings.Count(rest, "}") != 1 || !strings.HasPrefix(rest, "{") {
					t.Errorf("key %q: want exactly one hash tag, right after the prefix", trunc(k))
					continue
				}
				tag := rest[1:strings.Index(rest, "}")]
				tags[tag] = true
				if cc, ok := b.Client.(*redis.ClusterClient); ok {
					slot, err := cc.ClusterKeySlot(ctx, k).Result()
					if err != nil {
						t.Fatal(err)
					}
					if s, ok := slots[tag]; ok && s != slot {
						t.Errorf("keys of one subject in slots %d and %d", s, slot)
					}
					slots[tag] = slot
				}
			}
			if len(tags) != len(hostileSubjects) {
				t.Errorf("%d distinct hash tags for %d subjects; want one per subject", len(tags), len(hostileSubjects))
			}
			t.Logf("%d hostile subjects: %d keys, %d hash tags", len(hostileSubjects), len(keys), len(tags))

			// Invalid subjects fail before reaching Redis.
			before := len(scanKeys(t, b.Client, prefix))
			for _, s := range []string{"", strings.Repeat("x", 1024+1), strings.Repeat("{", 1<<20)} {
				if _, err := lim.Allow(ctx, s); !errors.Is(err, throttle.ErrInvalidSubject) {
					t.Errorf("Allow(%d-byte subject) = %v; want ErrInvalidSubject", len(s), err)
				}
				if err := lim.Wait(ctx, s); !errors.Is(err, throttle.ErrInvalidSubject) {
					t.Errorf("Wait(%d-byte subject) = %v; want ErrInvalidSubject", len(s), err)
				}
				if _, err := bucket.ReserveN(ctx, s, 1); !errors.Is(err, throttle.ErrInvalidSubject) {
					t.Errorf("Reserve(%d-byte subject) = %v; want ErrInvalidSubject", len(s), err)
				}
				if _, err := bucket.PauseFor(ctx, s, time.Second); !errors.Is(err, throttle.ErrInvalidSubject) {
					t.Errorf("PauseFor(%d-byte subject) = %v; want ErrInvalidSubject", len(s), err)
				}
				if err != nil && strings.Contains(err.Error(), s) && len(s) > 0 {
					t.Errorf("error repeats the whole subject")
				}
			}
			if after := len(scanKeys(t, b.Client, prefix)); after > before { // short-lived pause keys may expire meanwhile
				t.Errorf("invalid subjects created %d keys", after-before)
			}
		})
	}
}

// trunc shortens s for messages.
func trunc(s string) string {
	if len(s) > 40 {
		return s[:40] + "…"
	}
	return s
}
