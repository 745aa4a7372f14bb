package throttle_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// fuzzBackends returns the Redis servers a fuzz target checks scripts on:
// an in-process miniredis, and the real Redis named by
// JOBTHROTTLE_REDIS_URL when it is set (scripts/test.sh sets it, so the
// seed corpus runs on both Lua engines in CI).
func fuzzBackends(f *testing.F) []redis.UniversalClient {
	f.Helper()
	mini := miniredis.NewMiniRedis()
	if err := mini.Start(); err != nil {
		f.Fatal(err)
	}
	f.Cleanup(mini.Close)
	clients := []redis.UniversalClient{redis.NewClient(&redis.Options{Addr: mini.Addr()})}
	if url := os.Getenv("JOBTHROTTLE_REDIS_URL"); url != "" {
		opts, err := redis.ParseURL(url)
		if err != nil {
			f.Fatal(err)
		}
		clients = append(clients, redis.NewClient(opts))
	}
	for _, c := range clients {
		f.Cleanup(func() { _ = c.Close() })
	}
	return clients
}

// FuzzLimitValidate builds a rule from arbitrary fields. Validate must never
// panic; a rule it accepts must be accepted by New and by the scripts, on
// miniredis (and real Redis in CI): AllowN, and for bucket rules ReserveN
// and Cancel, return no error but a *CapacityError or *DelayError, with a
// Result whose durations and Remaining are not negative. A rule it rejects
// is a *ConfigError naming the rule.
func FuzzLimitValidate(f *testing.F) {
	type seed struct {
		algo                            uint8
		count, period, burst, precision int64
		n                               int64
	}
	for _, s := range []seed{
		{1, 10, int64(time.Second), 10, 0, 1},
		{2, 3, int64(time.Minute), 0, 0, 2},
		{3, 100, int64(time.Hour), 0, int64(time.Second), 5},
		{4, 20, int64(time.Second), 5, 0, 1},
		{5, 20, int64(time.Second), 5, 0, 3},
		{5, 1 << 40, int64(time.Microsecond), 1 << 40, 0, 1}, // extremes that Validate accepts
		{4, 1, int64(maxPeriod), 1, 0, 1},                    // one per ten years
		{3, 1_000_000, int64(maxPeriod), 0, 0, 1},            // default precision
		{2, maxLogCount, int64(time.Second), 0, 0, 10},       // the biggest log
		{1, 1, 1, 1, 1, 1},                                   // below 1µs
		{0, 1, int64(time.Second), 1, 0, 1},                  // no algorithm
		{7, 1, int64(time.Second), 1, 0, 1},                  // unknown algorithm (6 is Concurrency)
		{5, -1, -1, -1, -1, -1},
		{4, 7, 3, 1 << 40, 0, 1 << 40},
	} {
		f.Add(s.algo, s.count, s.period, s.burst, s.precision, s.n)
	}
	clients := fuzzBackends(f)
	var mu sync.Mutex
	seq := 0
	f.Fuzz(func(t *testing.T, algo uint8, count, period, burst, precision, n int64) {
		rule := throttle.Rule{
			Name:      "fuzz",
			Algorithm: fuzzAlgorithm(algo),
			Limit:     throttle.Limit{Count: int(count), Period: time.Duration(period), Burst: int(burst)},
			Precision: time.Duration(precision),
		}
		err := rule.Validate()
		if err != nil {
			var ce *throttle.ConfigError
			if !errors.As(err, &ce) || ce.Rule != "fuzz" || ce.Field == "" || ce.Reason == "" {
				t.Fatalf("Validate(%+v) = %v; want a *ConfigError naming rule and field", rule, err)
			}
			return
		}
		// Keys of one algorithm are left from earlier inputs with other
		// parameters, which the scripts must also accept; another
		// algorithm's keys have another type (WRONGTYPE), so each
		// algorithm has its own prefix.
		mu.Lock()
		seq++
		prefix := "fuzz:" + string(rule.Algorithm) + ":" + strings.Repeat("x", seq%3) + ":"
		mu.Unlock()
		for _, rdb := range clients {
			lim, err := throttle.New(rdb, throttle.Options{Prefix: prefix}, rule)
			if err != nil {
				t.Fatalf("Validate accepted %+v but New = %v", rule, err)
			}
			ctx := context.Background()
			if rule.Algorithm == throttle.Concurrency {
				continue // takes places with Wait and Release: concurrency_test.go
			}
			res, err := lim.AllowN(ctx, "s", int(n))
			if !acceptable(err) {
				t.Fatalf("%v: AllowN(%d) = %v", rule, n, err)
			}
			if err == nil && (res.Remaining < 0 || res.RetryAfter < 0 || res.ResetAfter < 0 || res.Rule != "fuzz") {
				t.Fatalf("%v: AllowN(%d) = %+v", rule, n, res)
			}
			if err == nil && !res.Allowed && res.RetryAfter == 0 {
				t.Fatalf("%v: AllowN(%d) denied with RetryAfter 0", rule, n)
			}
			if rule.Algorithm != throttle.TokenBucket && rule.Algorithm != throttle.GCRA {
				continue
			}
			for range 2 {
				r, err := lim.ReserveN(ctx, "s", int(n))
				if !acceptable(err) {
					t.Fatalf("%v: ReserveN(%d) = %v", rule, n, err)
				}
				if err != nil {
					continue
				}
				if r.Delay() < 0 {
					t.Fatalf("%v: ReserveN(%d) delay %v", rule, n, r.Delay())
				}
				if err := r.Cancel(ctx); err != nil {
					t.Fatalf("%v: Cancel = %v", rule, err)
				}
			}
			// A deadline bounds the wait the script may grant (ARGV[3]); it
			// may also pass during the round trip itself.
			dctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
			_, err = lim.ReserveN(dctx, "s", int(n))
			cancel()
			if !acceptable(err) && !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("%v: ReserveN(%d) with 1ms deadline = %v", rule, n, err)
			}
		}
	})
}

// acceptable reports whether err is one the library may answer a valid
// rule with: none, a request over capacity or below 0, or a wait past a
// bound. Redis and script errors are not.
func acceptable(err error) bool {
	var de *throttle.DelayError
	return err == nil || errors.Is(err, throttle.ErrExceedsCapacity) || errors.As(err, &de) ||
		strings.Contains(err.Error(), "must not be negative") && !errors.Is(err, throttle.ErrRedis)
}

// FuzzSubjectKey checks the subject encoding (export_test.go) and the keys:
// EncodeSubject never panics; two distinct subjects never share an
// encoding (decoding gives the subject back); an encoding holds no '{' or
// '}' (so a subject cannot end its hash tag) and only letters, digits,
// -._~@/+=, and %XX; and the key a Limiter really sends (recorded from its
// EVALSHA on miniredis) is <prefix>{<encoding>}:<rule>.
func FuzzSubjectKey(f *testing.F) {
	for _, s := range [][2]string{
		{"tenant-42", "tenant-43"}, {"{", "}"}, {"A", "%41"}, {"%", "%25"}, {"a:b", "a%3Ab"},
		{"\x00", ""}, {"\xff\xfe", "日本"}, {"}{", "{}"}, {"x}:r", "x"}, {"a b", "a+b"},
	} {
		f.Add(s[0], s[1])
	}
	mini := miniredis.NewMiniRedis()
	if err := mini.Start(); err != nil {
		f.Fatal(err)
	}
	f.Cleanup(mini.Close)
	rdb := redis.NewClient(&redis.Options{Addr: mini.Addr()})
	f.Cleanup(func() { _ = rdb.Close() })
	keys := &keyRecorder{}
	rdb.AddHook(keys)
	const prefix = "fz:"
	lim, err := throttle.New(rdb, throttle.Options{Prefix: prefix},
		throttle.Rule{Name: "r", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(1000)})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, a, b string) {
		ea, erra := throttle.EncodeSubject(a)
		eb, errb := throttle.EncodeSubject(b)
		for _, c := range []struct {
			s, enc string
			err    error
		}{{a, ea, erra}, {b, eb, errb}} {
			if c.err != nil {
				if !errors.Is(c.err, throttle.ErrInvalidSubject) || (c.s != "" && len(c.s) <= maxSubjectLen) {
					t.Fatalf("EncodeSubject(%q) = %v; only empty or over-long subjects are invalid", c.s, c.err)
				}
				continue
			}
			if strings.ContainsAny(c.enc, "{}") {
				t.Fatalf("EncodeSubject(%q) = %q contains a brace", c.s, c.enc)
			}
			dec, ok := decodeSubject(c.enc)
			if !ok || dec != c.s {
				t.Fatalf("EncodeSubject(%q) = %q, which decodes to %q, %v", c.s, c.enc, dec, ok)
			}
			keys.reset()
			if _, err := lim.Allow(context.Background(), c.s); err != nil {
				t.Fatalf("Allow(%q) = %v", c.s, err)
			}
			if got, want := keys.first(), prefix+"{"+c.enc+"}:r"; got != want {
				t.Fatalf("Allow(%q) sent key %q; want %q", c.s, got, want)
			}
		}
		if erra == nil && errb == nil && a != b && ea == eb {
			t.Fatalf("subjects %q and %q share the encoding %q", a, b, ea)
		}
	})
}

// decodeSubject inverts EncodeSubject, or reports that enc is not an
// encoding it could have produced.
func decodeSubject(enc string) (string, bool) {
	var b strings.Builder
	for i := 0; i < len(enc); i++ {
		c := enc[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9', strings.IndexByte("-._~@/+=,", c) >= 0:
			b.WriteByte(c)
		case c == '%' && i+2 < len(enc) && isUpperHex(enc[i+1]) && isUpperHex(enc[i+2]):
			v := unhex(enc[i+1])<<4 | unhex(enc[i+2])
			if 'a' <= v && v <= 'z' || 'A' <= v && v <= 'Z' || '0' <= v && v <= '9' || strings.IndexByte("-._~@/+=,", v) >= 0 {
				return "", false // a safe byte is never escaped: the encoding is canonical
			}
			b.WriteByte(v)
			i += 2
		default:
			return "", false
		}
	}
	return b.String(), true
}

func isUpperHex(c byte) bool { return '0' <= c && c <= '9' || 'A' <= c && c <= 'F' }

func unhex(c byte) byte {
	if c <= '9' {
		return c - '0'
	}
	return c - 'A' + 10
}

// keyRecorder is a go-redis hook that keeps KEYS[1] of the last script
// call.
type keyRecorder struct {
	mu  sync.Mutex
	key string
}

func (r *keyRecorder) reset() { r.mu.Lock(); r.key = ""; r.mu.Unlock() }

func (r *keyRecorder) first() string { r.mu.Lock(); defer r.mu.Unlock(); return r.key }

func (*keyRecorder) DialHook(next redis.DialHook) redis.DialHook { return next }
func (*keyRecorder) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (r *keyRecorder) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if name := strings.ToLower(cmd.Name()); name == "evalsha" || name == "eval" {
			if args := cmd.Args(); len(args) > 3 {
				if k, ok := args[3].(string); ok {
					r.mu.Lock()
					r.key = k
					r.mu.Unlock()
				}
			}
		}
		return next(ctx, cmd)
	}
}

// The package's bounds (limit.go, keys.go), which the fuzz cases probe.
const (
	maxPeriod     = 10 * 365 * 24 * time.Hour
	maxLogCount   = 1_000_000
	maxSubjectLen = 1024
)

// fuzzAlgorithm maps a fuzzed byte to an algorithm: 1–5 name the five in
// order, 0 none, anything else an unknown name.
func fuzzAlgorithm(b uint8) throttle.Algorithm {
	all := []throttle.Algorithm{"", throttle.FixedWindow, throttle.SlidingLog, throttle.SlidingWindow, throttle.TokenBucket, throttle.GCRA, throttle.Concurrency}
	if int(b) < len(all) {
		return all[b]
	}
	return throttle.Algorithm(fmt.Sprintf("algorithm-%d", b))
}
