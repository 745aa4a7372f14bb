package throttle

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// bucket_fast.lua against the general script (allow.lua over
// bucket.lua): the same random calls, at the same Redis times, on two keys
// that start alike, must get the same replies and leave the same state and
// TTL, byte for byte. A ticket differs in form (the fast script replies
// the time to act as an integer, which reply.tickets makes "<w> 0"), so
// tickets are compared as the limiter reads them, and each is then
// refunded (a Group's undo, or a Cancel) by the general script, which must
// leave both keys alike again. Both short forms of the state (bucket.lua)
// must come up, and the fast script must never hand either back. An
// allow sent as AllowN sends it (answerOnly) is answered in one integer,
// from which the limiter must read the Result it reads from the general
// script's array.
func TestFastBucketScriptAgreesWithDriver(t *testing.T) {
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { _ = rdb.Close() })
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(14, 1))
	now := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	m.SetTime(now)
	intervals := []int64{1, 7, 1000, 5000, 333_333, 1_000_000, 432_000_000}
	decisions, handedBack, answers := 0, 0, 0
	forms := map[string]int{}
	for trial := range 100 {
		T := intervals[rng.IntN(len(intervals))]
		burst := int64(1 + rng.IntN(12))
		algo := []Algorithm{TokenBucket, GCRA}[trial%2]
		kf, kg := fmt.Sprintf("f%d", trial), fmt.Sprintf("g%d", trial)
		for range 40 {
			step := time.Duration(rng.Int64N(3*T*burst/2+2)) * time.Microsecond
			now = now.Add(step)
			m.SetTime(now)
			m.FastForward(step)
			opName := []string{"allow", "reserve", "a"}[rng.IntN(3)]
			n := rng.Int64N(burst + 2)
			maxWait := []int64{-1, 0, rng.Int64N(3 * T * burst)}[rng.IntN(3)]
			if !fastRule(algo, 1, T, burst) {
				if T*burst < fastBurstLimit {
					t.Fatalf("T=%d burst=%d: not a fast rule", T, burst)
				}
				continue
			}
			answer := opName == "a" // AllowN's call, answered in one integer
			if answer {
				opName = "allow"
			}
			line := fastLine(kf, op(opName), int(n), maxWait, T, burst)
			if fastScript(scripts[algo].allow, line) != fastBucketScript {
				t.Fatalf("fastScript(%v) did not choose the fast script", line)
			}
			if answer {
				line[lineHead+1] = answerOnly
			}
			// allow.lua's form of the same call, as run sends it when
			// handed back.
			_, args := lineCall(allowLine(scripts[algo].allow, line))
			if args[0] != "allow" && args[0] != "reserve" {
				t.Fatalf("allowLine sends op %v to allow.lua", args[0])
			}
			got, err := fastBucketScript.Run(ctx, rdb, []string{kf}, line[lineHead+1:]...).Result()
			if err != nil {
				t.Fatalf("fast %v: %v", args, err)
			}
			fast, _ := got.([]any)
			v, answered := got.(int64)
			if answer && !answered && len(fast) != 0 {
				t.Fatalf("answer-only allow %v: reply %v, want one integer", args, got)
			}
			if !answered && len(fast) == 0 { // handed back, as run does
				if v := mustGet(m, kf); stateForm(v) != "decimal" {
					t.Fatalf("%v: the %s state %q was handed back", args, stateForm(v), v)
				}
				handedBack++
				if fast, err = scripts[algo].allow.Run(ctx, rdb, []string{kf}, args...).Slice(); err != nil {
					t.Fatal(err)
				}
			}
			gen, err := scripts[algo].allow.Run(ctx, rdb, []string{kg}, args...).Slice()
			if err != nil {
				t.Fatalf("general %v: %v", args, err)
			}
			decisions++
			if answered {
				// The Result AllowN reads from the one integer must be
				// the one it reads from the general script's array.
				p := fastPolicy(t, algo, T, burst)
				want, err := p.parse(gen)
				if err != nil {
					t.Fatal(err)
				}
				if got := p.compactResult(v, int(n)); got != want.Result {
					t.Fatalf("T=%d burst=%d %v: answer %d reads as\n%+v, the general reply %v as\n%+v", T, burst, args, v, got, gen, want.Result)
				}
				answers++
			} else if len(fast) != len(gen) || fmt.Sprint(fast[:6]) != fmt.Sprint(gen[:6]) {
				t.Fatalf("T=%d burst=%d %v:\nfast    %v\ngeneral %v", T, burst, args, fast, gen)
			}
			if len(fast) == 7 {
				tf, tg := reply{raw: fast}.tickets(1)[0], reply{raw: gen}.tickets(1)[0]
				if tf != tg {
					t.Fatalf("%v: tickets %q and %q", args, tf, tg)
				}
				if rng.IntN(4) == 0 {
					refund := []any{[]string{"refund", "undo"}[rng.IntN(2)], n, int64(-1), string(algo), int64(1), T, burst}
					keysF := []string{kf, "pause-f", kf + "!cancelled", kf + "!reset"}
					keysG := []string{kg, "pause-g", kg + "!cancelled", kg + "!reset"}
					if err := scripts[algo].allow.Run(ctx, rdb, keysF, append(refund, tf)...).Err(); err != nil {
						t.Fatal(err)
					}
					if err := scripts[algo].allow.Run(ctx, rdb, keysG, append(refund, tg)...).Err(); err != nil {
						t.Fatal(err)
					}
				}
			}
			if vf, vg := m.Exists(kf) && mustGet(m, kf) == mustGet(m, kg), m.Exists(kg); vf != vg || m.TTL(kf) != m.TTL(kg) {
				t.Fatalf("T=%d burst=%d after %v: state %q (TTL %v) and %q (TTL %v)", T, burst, args,
					mustGet(m, kf), m.TTL(kf), mustGet(m, kg), m.TTL(kg))
			}
			if m.Exists(kf) {
				forms[stateForm(mustGet(m, kf))]++
			}
		}
	}
	t.Logf("%d decisions alike, %d of them handed back, %d answered in one integer; states after them: %v", decisions, handedBack, answers, forms)
	if forms["integer"] == 0 || forms["12-byte"] == 0 {
		t.Fatalf("states after the calls: %v; want both short forms", forms)
	}
	if answers < decisions/4 {
		t.Fatalf("%d of %d decisions answered in one integer; want about a third", answers, decisions)
	}
}

// fastPolicy is the policy of a one-rule limiter of algorithm a with
// interval T µs and burst: one whose calls go to the fast script.
func fastPolicy(t *testing.T, a Algorithm, T, burst int64) policy {
	t.Helper()
	p, err := newPolicy("", []Rule{{Name: "r", Algorithm: a, Limit: Limit{Count: 1, Period: time.Duration(T) * time.Microsecond, Burst: int(burst)}}})
	if err != nil || !p.fast {
		t.Fatalf("T=%d burst=%d: policy %v, fast %v", T, burst, err, p.fast)
	}
	return p
}

// stateForm names the form of a bucket state (bucket.lua): "integer" (the
// TAT alone, in decimal), "12-byte", or "decimal" (any other).
func stateForm(v string) string {
	if len(v) == 12 && v[0] >= 0xF0 {
		return "12-byte"
	}
	if _, err := strconv.ParseInt(v, 10, 64); err == nil {
		return "integer"
	}
	return "decimal"
}

func mustGet(m *miniredis.Miniredis, k string) string {
	v, _ := m.Get(k)
	return v
}

// A state the fast script cannot read (one written before the compact
// form, here the decimal "<TAT> <ev>") is handed back, untouched, and the
// limiter's own script decides the call and leaves the compact form; an
// Allow of a one-rule bucket limiter is one EVALSHA of the fast script
// otherwise.
func TestFastBucketScriptHandsBackOtherStates(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		l := mustNew(t, rdb, Options{NoBatching: true}, Rule{Name: "r", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(5)})
		var shas []string
		rdb.AddHook(evalshaRecorder{&shas})
		k := "jobthrottle:{s}:r"
		us := time.Now().UnixMicro()
		m.Set(k, fmt.Sprintf("%d %d", us+300_000, us))
		m.SetTTL(k, 300*time.Millisecond)
		// 5 of burst 5 with 3 intervals (300ms) taken: 2 left.
		if res := allow(t, l, "s", 2); !res.Allowed || res.Remaining != 0 {
			t.Fatalf("allow 2 over a decimal state: %+v, want allowed with 0 left", res)
		}
		if got := shas; len(got) != 2 || got[0] != fastBucketScript.Hash() || got[1] != l.scripts.allow.Hash() {
			t.Fatalf("EVALSHAs %v: want the fast script, handing back, then the limiter's", got)
		}
		if v, _ := m.Get(k); len(v) != 12 {
			t.Fatalf("state %q after the general script: want the compact form", v)
		}
		shas = shas[:0]
		if res := allow(t, l, "s", 1); res.Allowed {
			t.Fatalf("a sixth permit in 0 s was allowed: %+v", res)
		}
		if !slices.Equal(shas, []string{fastBucketScript.Hash()}) {
			t.Fatalf("EVALSHAs %v: want the fast script alone", shas)
		}
	})
}

// evalshaRecorder records the script hash of every EVALSHA sent alone.
type evalshaRecorder struct{ shas *[]string }

func (r evalshaRecorder) DialHook(next redis.DialHook) redis.DialHook { return next }
func (r evalshaRecorder) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if args := cmd.Args(); strings.EqualFold(cmd.Name(), "evalsha") && len(args) > 1 {
			*r.shas = append(*r.shas, fmt.Sprint(args[1]))
		}
		return next(ctx, cmd)
	}
}
func (r evalshaRecorder) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// The previous version's fast script returned, as an allow's ticket, the
// 12-byte state it wrote (TAT and TAT − ev); tickets held across an upgrade
// must still refund, for one release, as the "<w> 0" naming the same time
// to act does.
func TestBucketRefundReadsPreviousTickets(t *testing.T) {
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { _ = rdb.Close() })
	ctx := context.Background()
	now := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	m.SetTime(now)
	const T, burst = 1000, int64(5)
	us := now.UnixMicro()
	for _, algo := range []Algorithm{TokenBucket, GCRA} {
		var states []string
		for i, tk := range []string{compactState(us+2*T, 2*T), fmt.Sprintf("%d 0", us)} {
			k := fmt.Sprintf("%s-%d", algo, i)
			for range 2 {
				if err := scripts[algo].allow.Run(ctx, rdb, []string{k}, "allow", 1, -1, string(algo), 1, T, burst, "").Err(); err != nil {
					t.Fatal(err)
				}
			}
			if err := scripts[algo].refund.Run(ctx, rdb, []string{k, "pause", k + "!cancelled", k + "!reset"}, "refund", 1, -1, string(algo), 1, T, burst, tk).Err(); err != nil {
				t.Fatal(err)
			}
			states = append(states, mustGet(m, k))
		}
		if want := strconv.FormatInt(us+T, 10); states[0] != want || states[1] != want {
			t.Fatalf("%s: states after refunding a previous and a current ticket %q, %q; want %q, %q", algo, states[0], states[1], want, want)
		}
	}
}

// compactState is bucket.lua's 12-byte form of TAT tat and TAT − ev d.
func compactState(tat, d int64) string {
	return string([]byte{byte(0xF0 + tat>>48), byte(tat >> 40), byte(tat >> 32), byte(tat >> 24), byte(tat >> 16), byte(tat >> 8), byte(tat),
		byte(d >> 32), byte(d >> 24), byte(d >> 16), byte(d >> 8), byte(d)})
}

// A batch (runPipelined) sends each call the fast script hands back again,
// in allow.lua's form, to the limiter's script: every call is decided,
// and the states it leaves are the short forms. An answer-only call
// (AllowN's) handed back is answered with the general script's array.
func TestFastBucketScriptHandsBackInABatch(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		l := mustNew(t, rdb, Options{}, Rule{Name: "r", Algorithm: TokenBucket, Limit: PerSecond(10).WithBurst(5)})
		us := time.Now().UnixMicro()
		var calls []*batchedCall
		for i, s := range []string{"a", "b", "c"} {
			if i > 0 { // a and the others: decimal states, handed back
				k := "jobthrottle:{" + s + "}:r"
				m.Set(k, fmt.Sprintf("%d %d", us+300_000, us))
				m.SetTTL(k, 300*time.Millisecond)
			}
			line, err := l.line(opAllow, s, 1, unbounded)
			if err != nil {
				t.Fatal(err)
			}
			if i != 1 { // a and c as AllowN sends them (answerOnly), b not
				line[lineHead+1] = answerOnly
			}
			calls = append(calls, &batchedCall{ctx: context.Background(), line: line})
		}
		for i, cmd := range l.runPipelined(context.Background(), l.scripts.allow, calls) {
			raw, err := cmd.Result()
			if err != nil {
				t.Fatalf("call %d: %v", i, err)
			}
			// a: answered in one integer; b and c, handed back: the
			// general script's array, whatever the op.
			if _, answered := raw.(int64); answered != (i == 0) {
				t.Fatalf("call %d: reply %v", i, raw)
			}
			rep, err := l.parseAllow(raw, 1)
			if want := []int{4, 1, 1}[i]; err != nil || !rep.Allowed || rep.Remaining != want {
				t.Fatalf("call %d: %+v, %v; want allowed with %d left", i, rep.Result, err, want)
			}
		}
		for _, s := range []string{"a", "b", "c"} {
			if v := mustGet(m, "jobthrottle:{"+s+"}:r"); stateForm(v) == "decimal" {
				t.Fatalf("%s: state %q after the batch; want a short form", s, v)
			}
		}
	})
}
