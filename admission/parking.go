package admission

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// Parking is the parking and waking of jobs over one wake-up ledger
// (Wakeups): the gates given it as Options.Parking record there the
// wake-ups of the jobs they park, and Run takes each due entry and acts on
// it: a parked job (JobEntry) is passed to the queue adapter's wake
// function, which moves it back to its queue; a line (LineEntry) is served
// by the gate of its name given to Serve, which records the wake-ups of the
// jobs the serving booked, or, for a gate with a Concurrency rule, its
// places are swept. A line whose gate this process has not is passed to
// another Parking of this process that has it (Join), or put back in the
// ledger for another process. It is safe for concurrent use.
type Parking struct {
	ledger *Wakeups
	opts   ParkingOptions

	mu      sync.Mutex
	gates   map[string]*Gate // by name; a nil gate: known, with nothing to serve
	retired map[string]bool  // names Serve was given before, and is no longer
	peers   map[*Parking]bool
	running atomic.Bool // Run is running: a peer may pass it lines
}

// ParkingOptions tune a Parking. The zero value uses every default.
type ParkingOptions struct {
	// Logger receives the debug line of a line dropped because no process
	// has its gate. If nil, slog.Default().
	Logger *slog.Logger
	// OnServe, if set, is called after each serving of a line by this
	// process, with the gate's name, the line's subject and what the
	// serving did: the turns it booked, and how many jobs still wait in
	// the line (0 once it is empty). The subject is for memory only: it
	// may be personal data, never a metric's label.
	OnServe func(name, subject string, s Served)
}

// A line entry that a process without its gate takes goes back to the
// ledger passAfter later, at most maxPassed times (about 15s of tries,
// which a fleet sharing the ledger with others takes its own from long
// before).
const (
	passAfter = 300 * time.Millisecond
	maxPassed = 50
)

// serveGuard is how long after a serving of a line began another process
// serves it, if the first died before scheduling the next.
const serveGuard = 5 * time.Second

// sweepMargin puts a sweep after the lease it waits for has expired on the
// Redis clock.
const sweepMargin = 10 * time.Millisecond

// NewParking returns the parking and waking of jobs over ledger.
func NewParking(ledger *Wakeups, opts ParkingOptions) (*Parking, error) {
	if ledger == nil {
		return nil, errors.New("admission: parking: nil ledger; give NewWakeups(rdb, WakeupsKey)")
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	return &Parking{ledger: ledger, opts: opts, gates: map[string]*Gate{}, retired: map[string]bool{}, peers: map[*Parking]bool{}}, nil
}

// Ledger returns the ledger the parking records wake-ups in.
func (p *Parking) Ledger() *Wakeups { return p.ledger }

// Serve replaces the gates whose lines this process serves, by name (a
// nil gate: a name this process knows, with no line nor places, whose
// entries are dropped). A name given before and not now is retired: its
// entries are dropped at once, not passed on, unless a peer (Join) has it.
func (p *Parking) Serve(gates map[string]*Gate) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for name := range p.gates {
		if _, kept := gates[name]; !kept {
			p.retired[name] = true
		}
	}
	p.gates = make(map[string]*Gate, len(gates))
	for name, g := range gates {
		p.gates[name] = g
		delete(p.retired, name)
	}
}

// gate returns the gate named name, whether this process knows the name,
// and whether it retired it.
func (p *Parking) gate(name string) (g *Gate, known, retired bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	g, known = p.gates[name]
	return g, known, p.retired[name]
}

type parkingKey struct{}

// Join returns ctx carrying p, for the job that ctx runs, and links p with
// every Parking over the same ledger that ctx already carries: the
// parkings of queue middlewares stacked over one job (an outer one's Join
// first). Linked parkings pass each other the lines they take from the
// ledger without their gate, at once, instead of through the ledger.
func (p *Parking) Join(ctx context.Context) context.Context {
	outer, _ := ctx.Value(parkingKey{}).([]*Parking)
	for _, q := range outer {
		if q == p {
			return ctx
		}
	}
	for _, q := range outer {
		if q.ledger.keys[0] == p.ledger.keys[0] {
			p.link(q)
			q.link(p)
		}
	}
	return context.WithValue(ctx, parkingKey{}, append(outer[:len(outer):len(outer)], p))
}

func (p *Parking) link(q *Parking) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.peers[q] = true
}

// peerWith returns a running peer that knows the gate name, or nil.
func (p *Parking) peerWith(name string) *Parking {
	p.mu.Lock()
	peers := make([]*Parking, 0, len(p.peers))
	for q := range p.peers {
		peers = append(peers, q)
	}
	p.mu.Unlock()
	for _, q := range peers {
		if _, known, _ := q.gate(name); known && q.running.Load() {
			return q
		}
	}
	return nil
}

// park records the wake-ups that gate name's decision d for a job leaves
// to the ledger: the sweep of its subject's places within a lease if it
// waits for one, the serving of its line if d.Serve says (by a process,
// or by d.Head's return: throttle.AdmitRequest.HeadServes), the jobs its
// call booked in its line (d.Handed, reported to OnServe), and the job
// itself at its slot unless it runs or waits in line. It returns whether a parked job will
// be woken, and what could not be recorded.
func (p *Parking) park(ctx context.Context, name string, req Request, d Decision) (woken bool, err error) {
	line := LineEntry{Rule: name, Subject: req.Subject}.Member()
	var errs []error
	if d.Lease > 0 {
		// Queued for a place: a place is handed on when it is released, or
		// when a call finds its lease expired; if every holder's process
		// died, nothing else would look. Once a lease, whatever the number
		// waiting.
		redisNow := d.Slot.Add(-time.Until(d.At))
		if err := p.ledger.AddIfAbsent(ctx, line, redisNow.Add(d.Lease+DefaultLead)); err != nil {
			errs = append(errs, fmt.Errorf("admission: cannot schedule the sweep of a concurrency limit; waiting jobs come back at their fallbacks: %w", err))
		}
	}
	if !d.Serve.IsZero() && d.Head == "" {
		// Moved, not added if absent: a serving's guard (serveGuard) may
		// still be in the ledger from a line that emptied, later than this
		// one needs.
		if err := p.ledger.Add(ctx, line, d.Serve.Add(DefaultLead)); err != nil {
			errs = append(errs, fmt.Errorf("admission: cannot schedule the serving of the subject's line; its jobs come back at their fallbacks: %w", err))
		}
	}
	// The jobs its call booked in its line, and the line's next head
	// (throttle.AdmitRequest.HeadServes: perhaps this job); and the job
	// itself at its slot, unless it runs or waits in line: one write.
	wakes := maps.Clone(d.Handed)
	if d.Head != "" {
		if wakes == nil {
			wakes = map[string]time.Time{}
		}
		wakes[d.Head] = d.Serve
	}
	if (len(d.Handed) > 0 || d.Waiting > 0) && p.opts.OnServe != nil {
		p.opts.OnServe(name, req.Subject, Served{Handed: d.Handed, Next: d.Serve, Waiting: d.Waiting}) // its call served the line
	}
	switch {
	case d.Outcome == Run:
		delete(wakes, req.name())
	case !d.InLine:
		if wakes == nil {
			wakes = map[string]time.Time{}
		}
		wakes[req.name()] = d.Slot
	}
	if len(wakes) == 0 {
		// In line: woken by the serving that books its turn (or by the
		// job ahead of it, whose return serves the line).
		return d.InLine, errors.Join(errs...)
	}
	if err := p.ledger.AddAll(ctx, wakes); err != nil {
		errs = append(errs, fmt.Errorf("admission: cannot record the wake-ups; the queue's own schedule brings the jobs back: %w", err))
		return false, errors.Join(errs...)
	}
	return d.Outcome == Park, errors.Join(errs...)
}

// Run takes the ledger's due entries until ctx ends, as Wakeups.Run does
// (opts), then returns nil: a job's is passed to wake, which moves the job
// back to its queue (or returns an error matching ErrWakeLater to be
// called again a Tick later); a line's is served here, passed to a peer,
// or put back for another process.
func (p *Parking) Run(ctx context.Context, opts RunOptions, wake func(ctx context.Context, job JobEntry) error) error {
	p.running.Store(true)
	defer p.running.Store(false)
	return p.ledger.Run(ctx, opts, func(ctx context.Context, member string) error {
		e, err := ParseEntry(member)
		switch e := e.(type) {
		case JobEntry:
			return wake(ctx, e)
		case LineEntry:
			return p.line(ctx, e)
		}
		return err
	})
}

// line serves or sweeps the line of e, or passes it on.
func (p *Parking) line(ctx context.Context, e LineEntry) error {
	g, known, retired := p.gate(e.Rule)
	switch {
	case !known:
		// Another parking's gate: a peer in this process (stacked
		// middlewares share the ledger) serves it; failing that, it goes
		// back to the ledger for another process (a fleet with other rules
		// on the same Redis), counted, so that the line of a gate no
		// process has any more (removed, then the fleet restarted) is
		// dropped after maxPassed tries instead of going round for ever. A
		// gate Serve retired is dropped at once.
		if q := p.peerWith(e.Rule); q != nil {
			return q.line(ctx, e)
		}
		if retired || e.Passed >= maxPassed {
			p.opts.Logger.Debug("admission: dropped the serving of a line no gate here has", "rule", e.Rule, "passed", e.Passed)
			return nil
		}
		// The shard it goes back to is released too (passedOn), so that
		// another process, not this one again, takes the next try.
		e.Passed++
		if err := p.ledger.Add(ctx, e.Member(), time.Now().Add(DefaultLead+passAfter)); err != nil {
			return err
		}
		return passedOn{member: e.Member()}
	case g == nil:
		return nil // a limiter that cannot book has no line nor places
	case g.leased:
		return p.sweep(ctx, g, e.Subject)
	}
	return p.serve(ctx, g, e.Subject)
}

// sweep brings the places of g's Concurrency rule for subject up to date,
// and comes back when the earliest lease expires while jobs still wait.
func (p *Parking) sweep(ctx context.Context, g *Gate, subject string) error {
	next, err := g.sweep(ctx, subject)
	if err != nil {
		return fmt.Errorf("admission: sweep of rule %q: %w", g.opts.Name, err)
	}
	if next.IsZero() {
		return nil
	}
	// The loop takes an entry DefaultLead before its slot: after the
	// expiry, then, not just before it.
	return p.ledger.Add(ctx, LineEntry{Rule: g.opts.Name, Subject: subject}.Member(), next.Add(DefaultLead+sweepMargin))
}

// serve serves subject's line under g: the jobs whose turns it books are
// woken just before their slots, and the serving comes back when the line
// needs it again.
func (p *Parking) serve(ctx context.Context, g *Gate, subject string) error {
	name := g.opts.Name
	member := LineEntry{Rule: name, Subject: subject}.Member()
	// The loop took the serving out of the ledger; if this process dies
	// before putting it back, another serves the line serveGuard later
	// instead of leaving it to the fallbacks of the jobs in it.
	guard := time.Now().Add(serveGuard)
	if err := p.ledger.Add(ctx, member, guard); err != nil {
		return fmt.Errorf("admission: serving the line of rule %q: %w: %w", name, err, ErrWakeLater)
	}
	s, err := g.Serve(ctx, subject)
	if err != nil {
		if errors.Is(err, throttle.ErrRedis) {
			// Try again a tick later; the jobs in line have fallbacks.
			return fmt.Errorf("admission: serving the line of rule %q: %w: %w", name, err, ErrWakeLater)
		}
		return fmt.Errorf("admission: serving the line of rule %q: %w", name, err)
	}
	if p.opts.OnServe != nil {
		p.opts.OnServe(name, subject, s)
	}
	wakes := s.Handed
	if !s.Next.IsZero() {
		if wakes == nil {
			wakes = map[string]time.Time{}
		}
		wakes[member] = s.Next.Add(DefaultLead)
	}
	if err := p.ledger.AddAll(ctx, wakes); err != nil {
		return err
	}
	if s.Next.IsZero() {
		// The line is empty: left in the ledger, the guard would have it
		// served every serveGuard for as long as the fleet runs (an idle
		// fleet paid a call per emptied line every 5 s). Forgotten only
		// if it is still the guard: a job that joined the line since has
		// moved it to when the line must be served.
		if err := p.ledger.removeIfAt(ctx, member, guard); err != nil {
			return fmt.Errorf("admission: serving the line of rule %q: %w: %w", name, err, ErrWakeLater)
		}
	}
	return nil
}

// WakeOnHandoff returns a throttle.Options.OnHandoff that wakes the jobs a
// freed place of a Concurrency rule was handed to, through ledger: each
// waiter's name is its JobEntry (Request.Waiter), recorded as due now, and
// the Run of any process takes it at once.
func WakeOnHandoff(ledger *Wakeups) func(waiters []string) {
	return func(waiters []string) {
		ctx, cancel := context.WithTimeout(context.Background(), handoffTimeout)
		defer cancel()
		for _, w := range waiters {
			if err := ledger.Add(ctx, w, time.UnixMicro(0)); err != nil {
				slog.Warn("admission: cannot wake a job handed a place of a concurrency rule; it comes back at its fallback", "member", w, "error", err)
			}
		}
	}
}

// handoffTimeout bounds WakeOnHandoff's writes.
const handoffTimeout = 5 * time.Second
