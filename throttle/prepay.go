package throttle

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strings"
	"time"
)

// Prepaid permits let a producer pace work at the source: it books each
// job's slot with PrepayN and schedules the job for that slot; the consumer
// that finally runs the job redeems the receipt instead of charging the
// rules a second time. The receipt lives in Redis, next to the rules' keys,
// in a sorted set <prefix>{<subject>}:!receipts scored by the slot's Redis
// time, so a consumer honours only receipts that this limiter's rules
// really charged for this subject, each once.

// defaultReceiptKeep is how long a receipt is kept after its slot when
// PrepayN is given keep ≤ 0: 24 hours. A job that runs later than that is charged
// again when it runs: the safe side of a lost receipt.
const defaultReceiptKeep = 24 * time.Hour

// receiptsKey returns <prefix>{<subject>}:!receipts. The subject must have
// passed encodeSubject.
func (p *policy) receiptsKey(subject string) string {
	return key(p.prefix, escape(subject), receiptsSuffix)
}

// member is the receipt set's member for id under this limiter's rules:
// a limiter with other rules does not find it.
func (p *policy) member(id string) string {
	return id + " " + strings.Join(p.keyRules, ",")
}

// PrepayN books n permits for subject like ReserveN (same bounds, same
// errors; every algorithm can prepay, the windows included, whose ledgers
// hold future admissions) and,
// in the same round trip, records a receipt for them in Redis, kept until
// keep after the slot (defaultReceiptKeep if keep ≤ 0). Pass
// Reservation.Receipt with the job to whoever acts on it, at Slot; it
// passes the receipt to Admit (AdmitRequest.Receipt) instead of charging
// the rules again. Cancel refunds the permits and drops the receipt.
//
// To book far ahead (a large batch), use a limiter whose MaxWait is zero
// or large enough, and a context without a deadline.
func (l *Limiter) PrepayN(ctx context.Context, subject string, n int, keep time.Duration) (*Reservation, error) {
	return l.prepay(ctx, subject, n, nil, keep)
}

// PrepayCosts is PrepayN with a cost per rule (see Costs): the receipt's
// turn takes each rule's own cost, and the consumer that redeems it
// passes the same costs (AdmitRequest.Costs), so that its Settle or
// SettleCosts corrects each rule from what the turn took. Errors are
// PrepayN's and AllowCosts's.
func (l *Limiter) PrepayCosts(ctx context.Context, subject string, c Costs, keep time.Duration) (*Reservation, error) {
	if err := l.open(); err != nil {
		return nil, err
	}
	n, per, err := l.costs(c)
	if err != nil {
		return nil, err
	}
	return l.prepay(ctx, subject, n, per, keep)
}

// prepay is PrepayN of n permits, with costs per rule per (nil: n under
// every rule).
func (l *Limiter) prepay(ctx context.Context, subject string, n int, per Costs, keep time.Duration) (*Reservation, error) {
	if err := l.open(); err != nil {
		return nil, err
	}
	if !l.oneSubject() {
		return nil, errOneSubject
	}
	if keep <= 0 {
		keep = defaultReceiptKeep
	}
	if keep > maxPeriod {
		return nil, fmt.Errorf("throttle: receipt keep %v: must be at most %v", keep, maxPeriod)
	}
	bound, byDeadline := l.waitBound(ctx, time.Now())
	id := newReceiptID()
	keys, args, err := prepayArgs{subject: subject, n: n, per: per, bound: micros(bound), receipt: id, keep: keep, after: l.opts.PrepayAfter}.build(&l.policy)
	if err != nil {
		return nil, err
	}
	// No fail-open here (opPrepay): a receipt that Redis never recorded
	// would only make the consumer charge again.
	rep, recv, err := l.call(ctx, opPrepay, keys, args)
	if err != nil {
		return nil, err
	}
	if !rep.Allowed {
		return nil, &DelayError{Rule: rep.Rule, RetryAfter: rep.RetryAfter, Deadline: byDeadline}
	}
	return &Reservation{lim: l, subject: subject, n: n, per: per, tickets: rep.tickets(len(l.rules)), receipt: id, booked: rep.redisNow,
		delay: rep.RetryAfter, at: l.clock.wake(recv, rep.redisNow, rep.RetryAfter),
		slot: time.UnixMicro(rep.redisNow).Add(rep.RetryAfter)}, nil
}

// Receipt returns the receipt of a reservation made by PrepayN: its id,
// to be passed to Admit (as AdmitRequest.Receipt) by whoever acts on it,
// and its slot on the Redis clock, by which every process orders its work
// (a wake-up ledger scores by it). Other reservations have none: "" and
// the zero time.
func (r *Reservation) Receipt() (id string, slot time.Time) {
	if r.receipt == "" {
		return "", time.Time{}
	}
	return r.receipt, r.slot
}

// dropReceipt forgets a receipt, so that it can no longer be redeemed,
// and reports whether it was already gone (lapsed, redeemed or expired);
// false with an error.
func (l *Limiter) dropReceipt(ctx context.Context, subject, receipt string) (gone bool, err error) {
	n, err := l.rdb.ZRem(ctx, l.receiptsKey(subject), l.member(receipt)).Result()
	if err = l.result(ctx, opDropReceipt, err); err != nil {
		return false, err
	}
	return n == 0, nil
}

// maxReceiptLen bounds the receipts Admit looks up; ours are 32 bytes.
const maxReceiptLen = 128

// newReceiptID returns 128 random bits in hex.
func newReceiptID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (Go 1.24+)
	return hex.EncodeToString(b[:])
}
