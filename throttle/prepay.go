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

// DefaultReceiptKeep is how long a receipt is kept after its slot when
// PrepayN is given keep ≤ 0. A job that runs later than that is charged
// again when it runs: the safe side of a lost receipt.
const DefaultReceiptKeep = 24 * time.Hour

// redeemScript is prelude.lua + redeem.lua; see redeem.lua for KEYS, ARGV
// and the reply.
var redeemScript = buildScript("prelude.lua", "redeem.lua")

// receiptsKey returns <prefix>{<subject>}:!receipts. The subject must have
// passed EncodeSubject.
func (l *Limiter) receiptsKey(subject string) string {
	return key(l.prefix, escape(subject), receiptsSuffix)
}

// member is the receipt set's member for id under this limiter's rules:
// a limiter with other rules does not find it.
func (l *Limiter) member(id string) string {
	return id + " " + strings.Join(l.keyRules, ",")
}

// PrepayN books n permits for subject like ReserveN (same bounds, same
// errors; every algorithm can prepay, the windows included, whose ledgers
// hold future admissions) and,
// in the same round trip, records a receipt for them in Redis, kept until
// keep after the slot (DefaultReceiptKeep if keep ≤ 0). Pass
// Reservation.Receipt with the job to whoever acts at TimeToAct; it calls
// Redeem instead of charging the rules again. Cancel refunds the permits
// and drops the receipt.
//
// To book far ahead (a large batch), use a limiter whose MaxWait is zero
// or large enough, and a context without a deadline.
func (l *Limiter) PrepayN(ctx context.Context, subject string, n int, keep time.Duration) (*Reservation, error) {
	if keep <= 0 {
		keep = DefaultReceiptKeep
	}
	if keep > MaxPeriod {
		return nil, fmt.Errorf("throttle: receipt keep %v: must be at most %v", keep, MaxPeriod)
	}
	bound, byDeadline := l.waitBound(ctx, time.Now())
	maxWait := int64(-1)
	if bound >= 0 {
		maxWait = bound.Microseconds()
	}
	keys, args, err := l.request("prepay", subject, n, maxWait, nil)
	if err != nil {
		return nil, err
	}
	id := newReceiptID()
	keys = append(keys, l.receiptsKey(subject))
	args = append(args, l.member(id), keep.Microseconds())
	reply, err := l.run(ctx, l.script, keys, args...).Slice()
	recv := time.Now()
	if err != nil {
		// No fail-open here: a receipt that Redis never recorded would
		// only make the consumer charge again.
		if l.opts.OnRedisError != nil {
			l.opts.OnRedisError(err, false)
		}
		return nil, &redisError{op: "prepay", err: err}
	}
	l.redisOK()
	res, redisNow, err := l.parse(reply)
	if err != nil {
		return nil, err
	}
	if !res.Allowed {
		return nil, &DelayError{Rule: res.Rule, RetryAfter: res.RetryAfter, Deadline: byDeadline}
	}
	return &Reservation{lim: l, subject: subject, n: n, tickets: tickets(reply), receipt: id,
		delay: res.RetryAfter, at: l.clock.wake(recv, redisNow, res.RetryAfter),
		slot: time.UnixMicro(redisNow).Add(res.RetryAfter)}, nil
}

// Receipt returns the id of a reservation made by PrepayN, to be passed
// to Redeem (or Admit, as AdmitRequest.Receipt) by whoever acts on it; ""
// for other reservations.
func (r *Reservation) Receipt() string { return r.receipt }

// Slot returns a prepaid reservation's slot on the Redis clock, by which
// every process orders its work (a wake-up ledger scores by it); the zero
// time for other reservations.
func (r *Reservation) Slot() time.Time { return r.slot }

// Redeem claims the permits that PrepayN booked under receipt, for
// subject, with this limiter's rules. If ok, the permits were charged
// already: do not charge them again; wait delay first (it is non-zero only
// if the caller came before the slot, by the Redis clock). If not ok (an
// unknown, expired or already redeemed receipt, or one made for another
// subject or other rules), charge as usual: the receipt proves nothing.
// Each receipt is redeemed at most once, so a retried job is charged.
func (l *Limiter) Redeem(ctx context.Context, subject, receipt string) (delay time.Duration, ok bool, err error) {
	if _, err := EncodeSubject(subject); err != nil {
		return 0, false, err
	}
	if receipt == "" || len(receipt) > maxReceiptLen {
		return 0, false, nil
	}
	us, err := l.run(ctx, redeemScript, []string{l.receiptsKey(subject)}, l.member(receipt)).Int64()
	if err != nil {
		if l.opts.OnRedisError != nil {
			l.opts.OnRedisError(err, false)
		}
		return 0, false, &redisError{op: "redeem", err: err}
	}
	if us < 0 {
		return 0, false, nil
	}
	return time.Duration(us) * time.Microsecond, true, nil
}

// dropReceipt forgets a receipt, so that it can no longer be redeemed.
func (l *Limiter) dropReceipt(ctx context.Context, subject, receipt string) error {
	if err := l.rdb.ZRem(ctx, l.receiptsKey(subject), l.member(receipt)).Err(); err != nil {
		return &redisError{op: "drop receipt", err: err}
	}
	return nil
}

// maxReceiptLen bounds the receipts Redeem looks up; ours are 32 bytes.
const maxReceiptLen = 128

// newReceiptID returns 128 random bits in hex.
func newReceiptID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (Go 1.24+)
	return hex.EncodeToString(b[:])
}
