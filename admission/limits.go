package admission

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// A limit has one truth: the workers'. Workers publish the limits of the
// rules they charge in a hash under their key prefix; a producer that
// books turns ahead (package enqueue) reads it before its first booking
// and refuses to book under another limit, since a booking is redeemed
// without a second check and a faster producer would break the workers'
// limit at the API.

// LimitsKey returns the hash in which workers publish their limits under
// prefix: one field per throttle rule name (the name in the rule's keys),
// whose value is the limit as DescribeLimit writes it.
func LimitsKey(prefix string) string { return prefix + "!limits" }

// limitsTTL is how long published limits outlive the last worker that
// published them: a producer long after every worker stopped books under
// its own limit again.
const limitsTTL = 7 * 24 * time.Hour

// DescribeLimit writes a rule's limit as workers publish it and as errors
// show it: "gcra 5 per 1s (burst 1)", "sliding_window 100 per 1m0s
// (precision 3s)", "concurrency 5 at once (lease 30s)", "calendar 1000
// per day@America/Los_Angeles". Two rules that decide alike have the same
// description.
func DescribeLimit(r throttle.Rule) string {
	l := r.Limit
	switch {
	case r.Algorithm == throttle.Concurrency:
		return fmt.Sprintf("concurrency %d at once (lease %v)", l.Count, l.Period)
	case r.Algorithm == throttle.CalendarWindow:
		return fmt.Sprintf("calendar %d per %v", l.Count, r.Calendar)
	case r.Algorithm.Bucket():
		return fmt.Sprintf("%s %d per %v (burst %d)", r.Algorithm, l.Count, l.Period, l.Burst)
	case r.Algorithm == throttle.SlidingWindow:
		p := r.Precision
		if p == 0 {
			p = max(l.Period/20, time.Microsecond)
		}
		return fmt.Sprintf("%s %d per %v (precision %v)", r.Algorithm, l.Count, l.Period, p)
	default:
		return fmt.Sprintf("%s %d per %v", r.Algorithm, l.Count, l.Period)
	}
}

// PublishLimits records the limits of rules in LimitsKey(prefix), for
// producers to check theirs against (CheckLimits). Workers call it when
// they start and after each reload: the last to publish a rule's limit
// is its truth.
func PublishLimits(ctx context.Context, rdb redis.UniversalClient, prefix string, rules []throttle.Rule) error {
	if len(rules) == 0 {
		return nil
	}
	fields := make([]any, 0, 2*len(rules))
	for _, r := range rules {
		fields = append(fields, r.Name, DescribeLimit(r))
	}
	key := LimitsKey(prefix)
	_, err := rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.HSet(ctx, key, fields...)
		p.PExpire(ctx, key, limitsTTL)
		return nil
	})
	if err != nil {
		return fmt.Errorf("admission: publishing the rules' limits: %w", err)
	}
	return nil
}

// LimitMismatchError is CheckLimits' answer when the workers charge a rule
// under another limit than the caller would book it.
type LimitMismatchError struct {
	Rule    string // the throttle rule's name
	Workers string // the limit the workers published (DescribeLimit)
	Ours    string // the limit the caller would book under
}

func (e *LimitMismatchError) Error() string {
	return fmt.Sprintf("admission: rule %q: the workers run it at %s, but this producer would book at %s; "+
		"a booking is redeemed without a second check, so it must be made under the workers' limit: "+
		"pace with the workers' rules file, or with their limit", e.Rule, e.Workers, e.Ours)
}

// CheckLimits compares rules with the limits the workers published under
// prefix. It returns a *LimitMismatchError for the first rule (by name)
// that the workers run under another limit, and nil when every rule
// matches or was never published (no worker has run it: the caller's
// limit is the only one there is).
func CheckLimits(ctx context.Context, rdb redis.UniversalClient, prefix string, rules []throttle.Rule) error {
	published, err := rdb.HGetAll(ctx, LimitsKey(prefix)).Result()
	if err != nil {
		return fmt.Errorf("admission: reading the workers' limits: %w", err)
	}
	rules = slices.Clone(rules)
	slices.SortFunc(rules, func(a, b throttle.Rule) int { return strings.Compare(a.Name, b.Name) })
	for _, r := range rules {
		theirs, ok := published[r.Name]
		if ours := DescribeLimit(r); ok && theirs != ours {
			return &LimitMismatchError{Rule: r.Name, Workers: theirs, Ours: ours}
		}
	}
	return nil
}
