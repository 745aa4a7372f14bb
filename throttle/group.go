package throttle

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// A Group takes permits from several limiters whose rules are over
// different subjects, such as one global rule and one rule per tenant. A
// policy of rules over the same subject belongs in one Limiter, which
// decides them in one atomic call; a Group acquires its parts one after
// another in the order given, and refunds the parts it already holds when
// a later one fails, so a failed request keeps nothing.
//
// A Group is safe for concurrent use.
type Group struct {
	parts []Part
}

// Part is one member of a Group.
type Part struct {
	Limiter *Limiter
	// Subject maps the caller's subject to this part's subject. If nil, the
	// caller's subject is used. Use Fixed for a subject shared by all
	// callers.
	Subject func(subject string) string
}

// Fixed returns a Part.Subject function that ignores the caller's subject
// and always names s: Part{Limiter: global, Subject: Fixed("global")}.
func Fixed(s string) func(string) string { return func(string) string { return s } }

// NewGroup returns a Group of the parts, in order. It returns an error if
// there is no part or a part has no Limiter.
func NewGroup(parts ...Part) (*Group, error) {
	if len(parts) == 0 {
		return nil, errors.New("throttle: NewGroup needs at least one Part")
	}
	for i, p := range parts {
		if p.Limiter == nil {
			return nil, &ConfigError{Field: "parts", Reason: fmt.Sprintf("part %d has a nil Limiter", i)}
		}
	}
	return &Group{parts: append([]Part(nil), parts...)}, nil
}

func (p Part) subject(s string) string {
	if p.Subject == nil {
		return s
	}
	return p.Subject(s)
}

// Allow is AllowN(ctx, subject, 1).
func (g *Group) Allow(ctx context.Context, subject string) (Result, error) {
	return g.AllowN(ctx, subject, 1)
}

// AllowN takes n permits from every part now, or from none. The Result is
// that of the first part that denied, or, if all allowed, of the part with
// the fewest remaining.
func (g *Group) AllowN(ctx context.Context, subject string, n int) (Result, error) {
	var held []*Reservation
	var best Result
	for i, p := range g.parts {
		res, r, err := p.Limiter.decide(ctx, "allow", p.subject(subject), n, -1, true)
		if err != nil || !res.Allowed {
			cancelAll(ctx, held)
			return res, err
		}
		held = append(held, r)
		if i == 0 || res.Remaining < best.Remaining {
			best = res
		}
	}
	return best, nil
}

// Wait is WaitN(ctx, subject, 1).
func (g *Group) Wait(ctx context.Context, subject string) error {
	return g.WaitN(ctx, subject, 1)
}

// WaitN blocks until every part has granted n permits. Bucket parts reserve
// their slot without sleeping; window parts wait their turn; then WaitN
// sleeps once, until the latest slot. If a part fails or ctx ends, every
// part already held is refunded. Errors are as for Limiter.WaitN.
func (g *Group) WaitN(ctx context.Context, subject string, n int) error {
	held := make([]*Reservation, 0, len(g.parts))
	for _, p := range g.parts {
		r, err := p.Limiter.acquire(ctx, p.subject(subject), n)
		if err != nil {
			cancelAll(ctx, held)
			return err
		}
		held = append(held, r)
	}
	last := held[0]
	for _, r := range held[1:] {
		if r.at.After(last.at) {
			last = r
		}
	}
	if d := time.Until(last.at); d > 0 {
		if err := sleep(ctx, d); err != nil {
			cancelAll(ctx, held)
			return err
		}
	}
	return nil
}

// cancelAll refunds every reservation, even after ctx has ended, and
// even after its time to act: the caller did not act on any (undo).
func cancelAll(ctx context.Context, held []*Reservation) {
	for _, r := range held {
		r.cancelDetached(ctx, true)
	}
}
