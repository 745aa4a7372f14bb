package admission

import (
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// TestStackTenant: one tenant's jobs over three API keys, each job under
// its key's limit inside the tenant's (one gate per limit, a subject per
// key and one for the tenant: several hash slots), the jobs of the keys
// given in turn, 300 then 3,000 at once. With the tenant binding (10/s a
// key, 15/s the tenant: the keys together ask 30/s) and with the keys
// binding (4/s a key, 15/s the tenant), every job runs once, each key and
// the tenant hold limit + burst in every second on the Redis clock, the
// backlog takes about the binding limit's time, and parks and limiter
// calls per job stay under the same bounds for 300 as for 3,000: with the
// keys binding, one park and about 3.3 calls (the keys' lines); with the
// tenant binding, about two parks and 4-6 calls: a job that the tenant
// holds back past its key's turn takes its key's turn again at the
// tenant's, both booked in the calls that take them, and parks until
// them; once the tenant holds one back further than the key's line
// reaches, the jobs of that key and tenant hold turns that meet, the
// tenant's first: those parked in the key's line before park once more.
// (Measured: 1.96-2.0 parks and 4.2-5.1 calls, 7.2-8.3 before turns were
// booked by the calls that take them; the order the workers' calls reach
// Redis moves the first seconds, while the tenant starts to bind.)
// The pace bound is what failed CI on 2026-11-26 (87 %, about one run in
// twenty on a loaded machine) before a tenant learnt to bind one key's
// jobs bound its other keys' too (stack_leads.go).
func TestStackTenant(t *testing.T) {
	for _, c := range []struct {
		name        string
		key, tenant int
		parks       float64
		calls       float64
	}{
		{"tenant-binds", 10, 15, 2.2, 6},
		{"key-binds", 4, 15, 1.05, 4},
	} {
		t.Run(c.name, func(t *testing.T) {
			for _, n := range []int{300, 3000} {
				t.Run(fmt.Sprint(n), func(t *testing.T) {
					stackTenant(t, tenantBed{n: n, stacks: 1, key: c.key, tenant: c.tenant, maxParks: c.parks, maxCalls: c.calls, slack: 4 * time.Second})
				})
			}
		})
	}
}

// tenantBed is one run of stackTenant.
type tenantBed struct {
	n, stacks, workers int           // jobs, stacks (processes), workers shared out among them (0: 8)
	key, tenant        int           // each key's limit a second, and the tenant's
	maxParks, maxCalls float64       // the most parks and limiter calls per job
	slack              time.Duration // how much longer than the binding limit's time the backlog may take
	kill               time.Duration // if set, when the last stack's workers stop (stackBed.kill)
}

// stackTenant runs TestStackTenant's backlog of c.n jobs over three keys
// of c.key per second each, within c.tenant per second, checking at most
// c.maxParks parks and c.maxCalls limiter calls per job; it returns the
// limiter calls per job and the share of the binding limit's rate the
// backlog was served at.
func stackTenant(t *testing.T, c tenantBed) (calls, pace float64) {
	const keys = 3
	n, stacks, key, tenant, slack := c.n, c.stacks, c.key, c.tenant, c.slack
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		ledger := redistest.PipeClient(m)
		defer ledger.Close()
		subsOf := func(id string) []string {
			i, _ := strconv.Atoi(id[len("job-"):])
			return []string{fmt.Sprintf("key-%d", i%keys), "acme"}
		}
		rules := []throttle.Rule{
			{Name: "key", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(key).WithBurst(1)},
			{Name: "tenant", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(tenant).WithBurst(1)},
		}
		b, p := newStackBed(t, rdb, ledger, n, subsOf, rules...)
		b.addStacks(rdb, p, stacks-1, rules...)
		b.workers, b.kill = c.workers, c.kill
		if c.kill > 0 {
			defer func() {
				// Every job the killed process parked ran on another
				// (each job ran once, and it admits nothing after).
				if b.lastParks.Load() == 0 {
					t.Error("the killed process parked no job: the test tests nothing")
				}
				t.Logf("the killed process parked %d jobs; %d admissions ended by the kill, their jobs given to the other processes",
					b.lastParks.Load(), b.requeued.Load())
			}()
		}
		if stacks > 1 {
			b.late = 2 * slack // (one stack: run's own bound)
		}
		if !b.stack.Meets() {
			t.Fatal("two GCRA gates: the stack does not meet")
		}
		rate := min(keys*key, tenant)
		want := time.Duration(n-1) * time.Second / time.Duration(rate)
		took := b.run(p, want)
		b.mu.Lock()
		defer b.mu.Unlock()
		for k, starts := range b.bySub {
			most := key + 1
			if k == "1/acme" {
				most = tenant + 1
			}
			if got := redistest.MaxInWindow(starts, time.Second); got > most {
				t.Errorf("%s: %d turns in one second on the Redis clock, want at most %d", k, got, most)
			}
		}
		// (Turns given back while later ones are booked are lost to a
		// bucket: a few of the tenant's, when its jobs start to meet.)
		if took > want*108/100+slack {
			t.Errorf("the backlog took %v, want about %v (the binding limit's)", took, want)
		}
		per := float64(b.calls.Load()) / float64(n)
		parks := float64(b.parks) / float64(n)
		t.Logf("%d jobs on %d stacks in %v (the binding limit alone: %v, %.0f %%): %.3f parks and %.3f limiter calls per job",
			n, stacks, took, want, 100*want.Seconds()/took.Seconds(), parks, per)
		if parks > c.maxParks {
			t.Errorf("%.3f parks per job, want at most %.2f", parks, c.maxParks)
		}
		if per > c.maxCalls {
			t.Errorf("%.3f limiter calls per job, want at most %.1f", per, c.maxCalls)
		}
		calls, pace = per, want.Seconds()/took.Seconds()
	})
	return calls, pace
}

// TestStackTenantProcesses is TestStackTenant's tenant-binds case, 300
// jobs, on three stacks over the same limits, as in three worker
// processes, the workers shared out among them: their holds reach the
// limits in any order, and still every job runs once, each key and the
// tenant hold limit + burst in every second on the Redis clock, and the
// backlog takes about the tenant's time (measured 95-98 % of its rate and
// 4.2-4.3 calls a job; 62-89 % and 7.5 before a job's turns were booked
// by the calls that take them and a key turn taken again at the tenant's,
// issue 24).
func TestStackTenantProcesses(t *testing.T) {
	stackTenant(t, tenantBed{n: 300, stacks: 3, key: 10, tenant: 15, maxParks: 2.2, maxCalls: 6, slack: 4 * time.Second})
}

// TestStackTenantHeld: the tenant-binds case of TestStackTenant as a
// fleet runs it, three stacks (processes) of 60 workers each, 300 then
// 3,000 jobs. Every job runs once and each key and the tenant hold limit
// + burst in every second on the Redis clock (stackTenant). A held job
// books its turns in the calls that take them and redeems them when it
// comes back, so the limiter calls per job do not grow from 300 jobs to
// 3,000 (at most 10 % more) and are at most 6 (measured 5.1-5.7; 8.4 and 7.3
// before turns were booked by the calls that take them), and the backlog
// is served at 80 % of the tenant's rate or more (measured 85-94 % for
// 300, 94-99 % for 3,000: the first second or two, while the keys' lines
// hand turns to jobs the tenant then holds back, serve few of the
// tenant's turns; issue 24 asks 90 %, not met for 300).
func TestStackTenantHeld(t *testing.T) {
	var calls, paces []float64
	for _, n := range []int{300, 3000} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			c, p := stackTenant(t, tenantBed{n: n, stacks: 3, workers: 180, key: 10, tenant: 15, maxParks: 2.6, maxCalls: 6, slack: 30 * time.Second})
			calls, paces = append(calls, c), append(paces, p)
		})
	}
	if len(calls) != 2 {
		return // a backlog failed (its subtest says why)
	}
	// Flat as the backlog grows: no more than 10 % more a job for ten
	// times the jobs. Fewer is not a cost that grows (the 300-job run's
	// first seconds weigh more in it: 5.73 against 5.12 once under the
	// race detector in CI, which the two-sided bound failed).
	if d := calls[1]/calls[0] - 1; d > 0.1 {
		t.Errorf("limiter calls per job: %.3f for 300 jobs, %.3f for 3,000: want at most 10 %% more", calls[0], calls[1])
	}
	for i, p := range paces {
		if p < 0.8 {
			t.Errorf("backlog %d served at %.0f %% of the tenant's rate, want at least 80 %%", i, 100*p)
		}
	}
}

// TestStackTenantKilled: TestStackTenantHeld's 300 jobs, and 5 s in, one
// of the three processes is killed: its workers stop, the admissions they
// were in, if any, end (their turns given back) and the queue gives those
// jobs to the other processes, which also run the jobs it parked (their
// wake-ups are in the shared ledger, their turns booked under their IDs).
// Nothing is lost: every job runs once, and each key and the tenant hold
// limit + burst in every second on the Redis clock.
func TestStackTenantKilled(t *testing.T) {
	stackTenant(t, tenantBed{n: 300, stacks: 3, workers: 180, key: 10, tenant: 15, maxParks: 2.6, maxCalls: 6.5, slack: 10 * time.Second, kill: 5 * time.Second})
}
