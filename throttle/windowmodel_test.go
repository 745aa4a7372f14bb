package throttle

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// windowModel is a plain Go model of one window algorithm over one key:
// decide answers a request of n at now (µs of Redis time) and charges it
// when admitted, as the script must.
type windowModel interface {
	decide(now int64, n int) (ok bool, retry, remaining, reset int64)
}

// fixedModel: permits counted in windows aligned to multiples of period.
type fixedModel struct {
	count, period, w, c int64
}

func (m *fixedModel) decide(now int64, n int) (bool, int64, int64, int64) {
	w := now / m.period
	if w != m.w {
		m.w, m.c = w, 0
	}
	end := (w+1)*m.period - now
	if m.c+int64(n) > m.count {
		return false, end, m.count - m.c, end
	}
	m.c += int64(n)
	return true, 0, m.count - m.c, end
}

// logModel: every admission time; one counts while it is after now - period.
type logModel struct {
	count, period int64
	times         []int64 // ascending
}

func (m *logModel) decide(now int64, n int) (bool, int64, int64, int64) {
	m.times = slices.DeleteFunc(m.times, func(t int64) bool { return t <= now-m.period })
	c := int64(len(m.times))
	if c+int64(n) > m.count {
		k := c + int64(n) - m.count // the request fits once the k oldest have left
		return false, m.times[k-1] + m.period - now, m.count - c, m.times[len(m.times)-1] + m.period - now
	}
	for range n {
		m.times = append(m.times, now)
	}
	return true, 0, m.count - c - int64(n), m.period
}

// counterModel: permits per bucket of precision; a bucket starting at s
// counts, whole, while any part of it lies in (now - period, now].
type counterModel struct {
	count, period, precision int64
	buckets                  map[int64]int64
}

func (m *counterModel) decide(now int64, n int) (bool, int64, int64, int64) {
	span := m.precision + m.period
	cur := now / m.precision * m.precision
	var c int64
	var starts []int64
	for s, v := range m.buckets {
		if s+span-now <= 0 {
			delete(m.buckets, s)
			continue
		}
		c += v
		starts = append(starts, s)
	}
	slices.Sort(starts)
	if c+int64(n) > m.count {
		need, freed := c+int64(n)-m.count, int64(0)
		var retry int64
		for _, s := range starts {
			if freed += m.buckets[s]; freed >= need {
				retry = s + span - now
				break
			}
		}
		return false, retry, m.count - c, starts[len(starts)-1] + span - now
	}
	if n > 0 {
		m.buckets[cur] += int64(n)
	}
	return true, 0, m.count - c - int64(n), cur + span - now
}

// Each window algorithm against its plain Go model on random sequences:
// random rules, random steps of the Redis clock, random n from 0 to the
// count. Every field of every Result must agree, to the microsecond.
func TestWindowsAgreeWithModels(t *testing.T) {
	for _, algo := range []Algorithm{FixedWindow, SlidingLog, SlidingWindow} {
		t.Run(string(algo), func(t *testing.T) {
			t.Parallel()
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				rng := rand.New(rand.NewPCG(11, uint64(registry[algo].rank)))
				ctx := context.Background()
				periods := []time.Duration{time.Second, 7 * time.Second, 1500 * time.Millisecond, time.Minute, 333 * time.Microsecond}
				decisions := 0
				for trial := 0; decisions < 3000; trial++ {
					rule := Rule{Name: "r", Algorithm: algo, Limit: Limit{Count: 1 + rng.IntN(12), Period: periods[rng.IntN(len(periods))]}}
					if algo == SlidingWindow && rng.IntN(2) == 0 {
						rule.Precision = time.Duration(1+rng.Int64N(int64(rule.Limit.Period/time.Microsecond))) * time.Microsecond
						if rule.Validate() != nil {
							rule.Precision = 0
						}
					}
					l := mustNew(t, rdb, Options{Prefix: "m:", NoBatching: trial%2 == 0}, rule)
					count, period := int64(rule.Limit.Count), rule.Limit.Period.Microseconds()
					var model windowModel
					switch algo {
					case FixedWindow:
						model = &fixedModel{count: count, period: period, w: -1}
					case SlidingLog:
						model = &logModel{count: count, period: period}
					default:
						model = &counterModel{count: count, period: period, precision: rule.precision().Microseconds(), buckets: map[int64]int64{}}
					}
					subject := fmt.Sprint("s", trial)
					for range 40 {
						if rng.IntN(3) > 0 {
							time.Sleep(time.Duration(1+rng.Int64N(2*period/count+1)) * time.Microsecond)
						}
						n := rng.IntN(rule.Limit.Count + 1)
						res, err := l.AllowN(ctx, subject, n)
						if err != nil {
							t.Fatalf("trial %d %v: AllowN(%d): %v", trial, rule, n, err)
						}
						decisions++
						ok, retry, remaining, reset := model.decide(time.Now().UnixMicro(), n)
						got := fmt.Sprint(res.Allowed, res.RetryAfter, res.Remaining, res.ResetAfter)
						want := fmt.Sprint(ok, time.Duration(retry)*time.Microsecond, remaining, time.Duration(reset)*time.Microsecond)
						if got != want {
							t.Fatalf("trial %d %v (precision %v) at +%v: AllowN(%d) = %s, model %s (allowed, retry, remaining, reset)",
								trial, rule, rule.precision(), at(), n, got, want)
						}
					}
				}
				t.Logf("%d decisions, 0 mismatches", decisions)
			})
		})
	}
}
