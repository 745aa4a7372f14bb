package main

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// The shares part (-shares) measures share_limit: one API key (a fixed
// subject, GCRA) shared fairly by tenants (fair_by), each tenant also
// limited on its own (worker.TaskRule.ShareLimit). A hot tenant's backlog
// is enqueued first, then a few small tenants' a second later, to three
// asynq servers in this process on a throwaway redis-server (fleet.go).
// The same backlog also runs with fair_by alone (no share limit), in the
// same run, as the baseline.

// sharesResult is the part's JSON: results/<date>-shares.json.
type sharesResult struct {
	partHead
	Config   sharesConfig `json:"config"`
	RuntimeS float64      `json:"runtime_s"`
	Runs     []*sharesRun `json:"runs"`
	Errors   []string     `json:"errors,omitempty"`
}

type sharesConfig struct {
	Servers     int     `json:"servers"`
	Concurrency int     `json:"concurrency"` // per server
	MaxWaitS    float64 `json:"max_wait_s"`
	// The key: GCRA, KeyRate/s, burst KeyBurst; each tenant's share
	// limit: ShareRate/s, burst ShareBurst.
	KeyRate    int `json:"key_rate"`
	KeyBurst   int `json:"key_burst"`
	ShareRate  int `json:"share_rate"`
	ShareBurst int `json:"share_burst"`
	// The small tenants are enqueued JoinAfterS after the hot one began.
	JoinAfterS float64      `json:"join_after_s"`
	Cases      []sharesCase `json:"cases"`
	// A run not done by CapFactor × its fair schedule + CapSlackS stops.
	CapFactor float64 `json:"cap_factor"`
	CapSlackS float64 `json:"cap_slack_s"`
	Nice      int     `json:"nice"`
}

// sharesCase is one backlog: Hot tasks of tenant "hot", then PerSmall of
// each of Small tenants; with the share limit or with fair_by alone.
type sharesCase struct {
	Hot        int  `json:"hot"`
	Small      int  `json:"small"`
	PerSmall   int  `json:"per_small"`
	ShareLimit bool `json:"share_limit"`
}

// sharesRun is one case's figures. Turns are on the Redis clock
// (admission.WaitedFrom(ctx).Turn; on one host the same clock as the
// local one), starts on the local clock.
type sharesRun struct {
	sharesCase
	N int `json:"n"`
	// IdealS is the least any schedule could take: the hot tenant alone at
	// its own limit (Hot / min(share, key)) or every task at the key's
	// rate, whichever is longer. FairS is the fair schedule: the hot
	// tenant alone until the others join, then every tenant at
	// min(share, key / tenants) until the small ones are done, then the
	// hot tenant alone again.
	IdealS    float64 `json:"ideal_s"`
	FairS     float64 `json:"fair_s"`
	CapS      float64 `json:"cap_s"`
	EnqueueS  float64 `json:"enqueue_hot_s"`
	JoinS     float64 `json:"join_s"`          // when the small tenants' enqueue began, after the hot's
	EnqueueSS float64 `json:"enqueue_small_s"` // how long their enqueue took
	Done      int     `json:"done"`            // distinct tasks started
	Finished  bool    `json:"finished"`        // all N before the cap
	TookS     float64 `json:"took_s"`          // first enqueue to last start (cap if not finished)
	counts
	// The most turns in any 1 s: of the key (bound key rate + burst), of
	// any one tenant (bound share rate + burst; none without the share
	// limit), and which tenant.
	MaxKeyTurns1s    int    `json:"max_key_turns_1s"`
	KeyBound1s       int    `json:"key_bound_1s"`
	MaxTenantTurns1s int    `json:"max_tenant_turns_1s"`
	MaxTenant        string `json:"max_tenant"`
	TenantBound1s    int    `json:"tenant_bound_1s,omitempty"`
	MaxKeyStarts1s   int    `json:"max_key_starts_1s"`
	// The hot tenant's rate on its turns, (k−1)/(last−first): before the
	// others joined, while any of them had tasks left (from the join to
	// the last small tenant's last turn: k/span), and after (alone).
	HotRateBefore float64 `json:"hot_rate_before_join"`
	HotRateWith   float64 `json:"hot_rate_with_others"`
	HotRateAfter  float64 `json:"hot_rate_alone_after"`
	HotMaxTurns1s int     `json:"hot_max_turns_1s"`
	// The small tenants, from each one's first enqueue: first and last
	// start; and the worst of them.
	SmallTenants  []smallTenant `json:"small_tenants"`
	SmallFirstMax float64       `json:"small_first_start_max_s"`
	SmallLastMax  float64       `json:"small_last_start_max_s"`
	// SmallLastFairS is their last start under the fair schedule:
	// PerSmall / min(share, key / tenants).
	SmallLastFairS float64 `json:"small_last_start_fair_s"`
}

type smallTenant struct {
	Tenant      string  `json:"tenant"`
	Done        int     `json:"done"`
	FirstStartS float64 `json:"first_start_s"`
	LastStartS  float64 `json:"last_start_s"`
	MaxTurns1s  int     `json:"max_turns_1s"`
}

func defaultSharesConfig() sharesConfig {
	return sharesConfig{Servers: 3, Concurrency: 20, MaxWaitS: 1,
		KeyRate: 100, KeyBurst: 1, ShareRate: 20, ShareBurst: 1, JoinAfterS: 1,
		Cases: []sharesCase{
			{Hot: 600, Small: 8, PerSmall: 60, ShareLimit: true},
			{Hot: 600, Small: 8, PerSmall: 60},
			{Hot: 300, Small: 8, PerSmall: 60, ShareLimit: true},
			{Hot: 1200, Small: 8, PerSmall: 60, ShareLimit: true},
		},
		CapFactor: 2, CapSlackS: 10, Nice: niceness}
}

// runSharesPart runs every case and writes results/<date>-shares.json.
func runSharesPart(logf func(string, ...any), cfg sharesConfig) error {
	t0 := time.Now()
	head, srv, err := startPart(logf, t0)
	if err != nil {
		return err
	}
	defer srv.Stop()
	res := &sharesResult{partHead: head, Config: cfg}
	for _, c := range cfg.Cases {
		r, err := runSharesCase(context.Background(), srv.Addr, c, cfg)
		if err != nil {
			res.Errors = append(res.Errors, fmt.Sprintf("shares hot=%d share_limit=%v: %v", c.Hot, c.ShareLimit, err))
			logf("shares hot=%d share_limit=%v: %v", c.Hot, c.ShareLimit, err)
			continue
		}
		logf("shares hot=%-4d small=%d×%d share_limit=%-5v done %d/%d in %.1fs (ideal %.1fs, fair %.1fs): %.3f calls, %.3f parks, %.0f Redis µs per task; most in 1 s: key %d (bound %d), tenant %d (%s); hot %.1f/s before, %.1f/s with others, %.1f/s after; small first ≤ %.2fs, last ≤ %.2fs (fair %.1fs)",
			r.Hot, r.Small, r.PerSmall, r.ShareLimit, r.Done, r.N, r.TookS, r.IdealS, r.FairS, r.CallsPerTask, r.ParksPerTask, r.RedisUsecPerTask,
			r.MaxKeyTurns1s, r.KeyBound1s, r.MaxTenantTurns1s, r.MaxTenant, r.HotRateBefore, r.HotRateWith, r.HotRateAfter, r.SmallFirstMax, r.SmallLastMax, r.SmallLastFairS)
		res.Runs = append(res.Runs, r)
	}
	res.Machine.LoadEnd = loadavg()
	res.RuntimeS = time.Since(t0).Seconds()
	return writePart(logf, t0, "shares", res)
}

// sharesSchedule returns a case's ideal and fair-schedule times, and the
// small tenants' fair time to their last start.
func sharesSchedule(c sharesCase, cfg sharesConfig) (ideal, fair, smallLast float64) {
	key := float64(cfg.KeyRate)
	alone := key
	if c.ShareLimit {
		alone = min(float64(cfg.ShareRate), key)
	}
	n := float64(c.Hot + c.Small*c.PerSmall)
	ideal = max(float64(c.Hot)/alone, n/key)
	each := min(alone, key/float64(c.Small+1))
	before := min(float64(c.Hot), cfg.JoinAfterS*alone)
	smallLast = float64(c.PerSmall) / each
	left := max(float64(c.Hot)-before-float64(c.PerSmall), 0)
	fair = cfg.JoinAfterS + smallLast + left/alone
	return ideal, fair, smallLast
}

// runSharesCase enqueues c.Hot tasks of tenant "hot", and JoinAfterS
// later c.PerSmall of each small tenant (all at once), to cfg.Servers
// workers whose rule's subject is one key shared by tenant, and waits
// until every task has started or the cap.
func runSharesCase(ctx context.Context, addr string, c sharesCase, cfg sharesConfig) (*sharesRun, error) {
	spec := fleetSpec{mode: modeParking, prefix: "sh", maxWait: secs(cfg.MaxWaitS), concurrency: cfg.Concurrency,
		rule:  throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(cfg.KeyRate).WithBurst(cfg.KeyBurst)},
		fixed: "key-1", fairBy: true}
	if c.ShareLimit {
		spec.shareLimit = throttle.PerSecond(cfg.ShareRate).WithBurst(cfg.ShareBurst)
	}
	f, before, err := openFleet(ctx, addr, spec, cfg.Servers)
	if err != nil {
		return nil, err
	}
	defer f.close()
	r := &sharesRun{sharesCase: c, N: c.Hot + c.Small*c.PerSmall, KeyBound1s: cfg.KeyRate + cfg.KeyBurst}
	if c.ShareLimit {
		r.TenantBound1s = cfg.ShareRate + cfg.ShareBurst
	}
	r.IdealS, r.FairS, r.SmallLastFairS = sharesSchedule(c, cfg)
	r.CapS = r.FairS*cfg.CapFactor + cfg.CapSlackS

	t0 := time.Now()
	if err := f.enqueue(ctx, "hot", c.Hot, false); err != nil {
		return nil, err
	}
	r.EnqueueS = time.Since(t0).Seconds()
	time.Sleep(time.Until(t0.Add(secs(cfg.JoinAfterS))))
	join := time.Now()
	r.JoinS = join.Sub(t0).Seconds()
	var wg sync.WaitGroup
	errs := make([]error, c.Small)
	for i := range c.Small {
		wg.Go(func() { errs[i] = f.enqueue(ctx, smallName(i), c.PerSmall, true) })
	}
	wg.Wait()
	r.EnqueueSS = time.Since(join).Seconds()
	for _, err := range errs {
		if err != nil {
			return nil, err
		}
	}
	r.Finished = f.waitStarts(r.N, t0.Add(secs(r.CapS)))
	starts, err := f.finish(ctx, r.N, before, &r.counts, &r.Done)
	if err != nil {
		return nil, err
	}
	r.TookS = r.CapS
	if r.Finished {
		r.TookS = lastStart(starts).Sub(t0).Seconds()
	}

	// Turns by tenant, the key's, and each small tenant's first enqueue.
	turns := map[string][]int64{}
	var all []int64
	at := map[string][]time.Time{}
	for _, s := range starts {
		at[s.tenant] = append(at[s.tenant], s.at)
		if !s.turn.IsZero() {
			turns[s.tenant] = append(turns[s.tenant], s.turn.UnixNano())
			all = append(all, s.turn.UnixNano())
		}
	}
	enq := map[string]time.Time{}
	f.mu.Lock()
	byID := map[string]string{}
	for _, s := range starts {
		byID[s.id] = s.tenant
	}
	for id, e := range f.enqueued {
		if who, ok := byID[id]; ok && (enq[who].IsZero() || e.Before(enq[who])) {
			enq[who] = e
		}
	}
	f.mu.Unlock()
	slices.Sort(all)
	r.MaxKeyTurns1s = maxInWindow(all, int64(time.Second))
	r.MaxKeyStarts1s, _ = mostInSecond(starts, "", time.Time{})
	for who, ts := range turns {
		slices.Sort(ts)
		if m := maxInWindow(ts, int64(time.Second)); m > r.MaxTenantTurns1s || (m == r.MaxTenantTurns1s && who < r.MaxTenant) {
			r.MaxTenantTurns1s, r.MaxTenant = m, who
		}
	}
	var smallEnd int64
	for i := range c.Small {
		who := smallName(i)
		st := smallTenant{Tenant: who, Done: len(at[who])}
		if len(at[who]) > 0 {
			first, last := slices.MinFunc(at[who], time.Time.Compare), slices.MaxFunc(at[who], time.Time.Compare)
			st.FirstStartS, st.LastStartS = first.Sub(enq[who]).Seconds(), last.Sub(enq[who]).Seconds()
		} else {
			st.FirstStartS, st.LastStartS = r.CapS, r.CapS
		}
		if ts := turns[who]; len(ts) > 0 {
			st.MaxTurns1s = maxInWindow(ts, int64(time.Second))
			smallEnd = max(smallEnd, ts[len(ts)-1])
		}
		r.SmallFirstMax, r.SmallLastMax = max(r.SmallFirstMax, st.FirstStartS), max(r.SmallLastMax, st.LastStartS)
		r.SmallTenants = append(r.SmallTenants, st)
	}
	hot := turns["hot"]
	if len(hot) > 0 {
		r.HotMaxTurns1s = maxInWindow(hot, int64(time.Second))
	}
	var pre, after []time.Time
	with := 0
	for _, ns := range hot {
		switch {
		case ns < join.UnixNano():
			pre = append(pre, time.Unix(0, ns))
		case ns <= smallEnd:
			with++
		default:
			after = append(after, time.Unix(0, ns))
		}
	}
	r.HotRateBefore, r.HotRateAfter = spanRate(pre), spanRate(after)
	if span := float64(smallEnd-join.UnixNano()) / 1e9; smallEnd > 0 && span > 0 {
		r.HotRateWith = float64(with) / span
	}
	return r, nil
}

func smallName(i int) string { return fmt.Sprintf("small-%d", i+1) }
