package worker

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// This file reads what a rule's limiter keeps in Redis about one task, for
// Explain. The key layout is throttle's (throttle/keys.go, prepay.go,
// admit.go's lineKeys, lua/admit.lua's header); throttle has no call that
// reads one task's booking or place without deciding for it, so it is
// written out again here, and TestExplainKeys pins it to the keys a real
// limiter writes.

// limiterKeys are the keys of one rule's limiter for one subject.
type limiterKeys struct {
	tag   string // <prefix>{<encoded subject>}:
	rules string // the limits' encoded names, joined by ","
	line  string // the line's encoded name: rules, or the limiter's Options.Line
}

func newLimiterKeys(prefix, subject string, limits []throttle.Rule) limiterKeys {
	names := make([]string, len(limits))
	for i, l := range limits {
		names[i] = keyEscape(l.Name)
	}
	k := limiterKeys{tag: prefix + "{" + keyEscape(subject) + "}:", rules: strings.Join(names, ",")}
	k.line = k.rules
	return k
}

// member is a booking's or receipt's member under the limiter's rules, in
// the receipt set and in the subject's line: "<id> <rule>,<rule>".
func (k limiterKeys) member(id string) string { return id + " " + k.rules }

// receipts is the sorted set of bookings and receipts, scored by their
// slots (µs of Redis time; negated while a paid turn waits for a place).
func (k limiterKeys) receipts() string { return k.tag + "!receipts" }

// lineKey is the subject's line under the limiter's rules (or its
// Options.Line): a sorted set of members by their places.
func (k limiterKeys) lineKey() string { return k.tag + "!line(" + k.line + ")" }

// limit is the key of one limit; a concurrency limit's is a sorted set of
// holders (scored by their leases' ends, > 0) and waiters (< 0, first
// come first).
func (k limiterKeys) limit(name string) string { return k.tag + keyEscape(name) }

// keyEscape is throttle's encoding of a subject or rule name inside keys:
// bytes other than ASCII letters, digits and -._~@/+=, are written %XX.
func keyEscape(s string) string {
	const hex = "0123456789ABCDEF"
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("-._~@/+=,", c) >= 0 {
			b.WriteByte(c)
			continue
		}
		b.WriteByte('%')
		b.WriteByte(hex[c>>4])
		b.WriteByte(hex[c&15])
	}
	return b.String()
}

// severalSubjects says why a limiter whose limits name subjects of their
// own keeps nothing per task (throttle.Rule.Subject).
const severalSubjects = "its limits are over several subjects: a task waits in its worker slot or is deferred, and nothing is booked for it"

// readRule reads what rule rc's limiter keeps about the task: its booking,
// its producer's receipt, and its position in its subject's line or in
// the queue for a place of the rule's concurrency limit.
func readRule(ctx context.Context, rdb redis.UniversalClient, ledger *admission.Wakeups, prefix string, rc rules.RuleConfig, info *asynq.TaskInfo) (*RuleState, error) {
	rs := &RuleState{Name: rc.Name, Limits: []string{}}
	several := false
	for _, l := range rc.Limits {
		rs.Limits = append(rs.Limits, l.Name)
		several = several || l.Subject != ""
		if l.Algorithm == throttle.Concurrency {
			rs.Concurrency = l.Name
		}
	}
	subject, err := rc.Subject.Of(info.Payload)
	if err == nil && subject == "" {
		err = errors.New("the subject is empty")
	}
	if err != nil {
		rs.SubjectError = err.Error()
		return rs, nil
	}
	rs.Subject = subject
	rs.readPriority(rc, info)
	if several {
		rs.NoBookings = severalSubjects
		return rs, nil
	}
	fail := func(what string, err error) error {
		return fmt.Errorf("worker: explain: reading %s under rule %q: %w", what, rc.Name, err)
	}
	k := newLimiterKeys(cmp.Or(prefix, throttle.DefaultPrefix), subject, rc.Limits)
	if rc.Nested {
		k.line = keyEscape(rc.Name) // its line of its own (rules.RuleConfig.Nested)
	}
	if rs.Turn, rs.TurnPaid, err = readSlot(ctx, rdb, k.receipts(), k.member(info.ID)); err != nil {
		return nil, fail("the task's booking", err)
	}
	if receipt := info.Headers[admission.ReceiptHeader]; receipt != "" {
		slot, paid, err := readSlot(ctx, rdb, k.receipts(), k.member(receipt))
		if err != nil {
			return nil, fail("the producer's receipt", err)
		}
		if paid && rs.Turn == nil {
			rs.Turn, rs.TurnPaid = slot, true
		} else if !paid {
			rs.Receipt = slot
		}
	}
	if rs.Concurrency != "" {
		if err := readPlace(ctx, rdb, k.limit(rs.Concurrency), admission.JobEntry{Queue: info.Queue, ID: info.ID}.Member(), rs); err != nil {
			return nil, fail("the queue for a place", err)
		}
		return rs, nil
	}
	if err := readLine(ctx, rdb, ledger, k, info.ID, rs); err != nil {
		return nil, fail("the subject's line", err)
	}
	return rs, nil
}

// readSlot reads the slot of member in the receipt set key: nil if it has
// none, and paid if the slot has come, paid, and waits for a place of a
// concurrency limit.
func readSlot(ctx context.Context, rdb redis.UniversalClient, key, member string) (slot *time.Time, paid bool, err error) {
	us, err := zscore(ctx, rdb, key, member)
	if err != nil || us == nil {
		return nil, false, err
	}
	if *us < 0 {
		paid, *us = true, -*us
	}
	t := time.UnixMicro(*us).UTC()
	return &t, paid, nil
}

// readLine reads the task's position in its subject's line, the line's length
// and when it is next served (its entry in ledger).
func readLine(ctx context.Context, rdb redis.UniversalClient, ledger *admission.Wakeups, k limiterKeys, id string, rs *RuleState) error {
	rank, err := rdb.ZRank(ctx, k.lineKey(), k.member(id)).Result()
	if errors.Is(err, redis.Nil) {
		return nil
	}
	if err != nil {
		return err
	}
	n, err := rdb.ZCard(ctx, k.lineKey()).Result()
	if err != nil {
		return err
	}
	rs.InLine, rs.Position, rs.LineLength = true, int(rank)+1, int(n)
	rs.LineServing, err = wakeupTime(ctx, ledger, admission.LineEntry{Rule: rs.Name, Subject: rs.Subject}.Member())
	if err != nil || rs.LineServing != nil {
		return err
	}
	// Served by its head's return (throttle.AdmitRequest.HeadServes): the
	// head's wake-up, under its waiter's name (lua/line.lua: :e holds
	// "n\nwaiter").
	head, err := rdb.ZRange(ctx, k.lineKey(), 0, 0).Result()
	if err != nil || len(head) == 0 {
		return err
	}
	e, err := rdb.HGet(ctx, k.lineKey()+":e", head[0]).Result()
	if errors.Is(err, redis.Nil) {
		return nil
	}
	if err != nil {
		return err
	}
	_, waiter, _ := strings.Cut(e, "\n")
	rs.LineServing, err = wakeupTime(ctx, ledger, waiter)
	return err
}

// readPlace reads whether the task, as member, holds a place of the
// concurrency limit at key, or its position in the queue for one.
func readPlace(ctx context.Context, rdb redis.UniversalClient, key, member string, rs *RuleState) error {
	score, err := zscore(ctx, rdb, key, member)
	if err != nil || score == nil {
		return err
	}
	if *score > 0 {
		rs.Holding = true
		return nil
	}
	// Waiters score below every holder: a waiter's rank counts the
	// waiters before it.
	rank, err := rdb.ZRank(ctx, key, member).Result()
	if err != nil {
		return err
	}
	rs.QueuedForPlace = int(rank) + 1
	return nil
}

// zscore returns member's score in the sorted set key as a whole number,
// or nil if it is not there.
func zscore(ctx context.Context, rdb redis.UniversalClient, key, member string) (*int64, error) {
	f, err := rdb.ZScore(ctx, key, member).Result()
	if errors.Is(err, redis.Nil) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	n := int64(f)
	return &n, nil
}

// wakeupTime returns when member is to be woken (Redis time), or nil if
// it is not in ledger.
func wakeupTime(ctx context.Context, ledger *admission.Wakeups, member string) (*time.Time, error) {
	at, ok, err := ledger.When(ctx, member)
	if err != nil || !ok {
		return nil, err
	}
	return &at, nil
}

// readPriority reads the task's level and the rule's age bound, where rc
// has a priority: as the workers derive them (FromRules, Middleware).
func (rs *RuleState) readPriority(rc rules.RuleConfig, info *asynq.TaskInfo) {
	if rc.Priority.PayloadField == "" && rc.Priority.Queues == nil {
		return
	}
	level, err := rc.Priority.Of(info.Payload, info.Queue)
	if err != nil {
		rs.PriorityError = err.Error()
		return
	}
	rs.Priority = &level
	rs.MaxAgeSeconds = rc.AgeBound().Seconds()
}
