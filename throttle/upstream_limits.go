package throttle

import (
	"context"
	"fmt"
	"strconv"
	"strings"
)

// Limits learned of the resource behind a policy, one per rule: an LLM
// provider announces its requests, input-token and output-token limits in
// its answers' headers (package httpthrottle reads them), each of which
// binds the rule that counts the same thing. They are kept in Redis, one
// hash per subject and limiter, <prefix>{<subject>}:!limits(<rules>), for
// UpstreamTTL after the last lesson, and read by Admit and Settle in the
// same script call as the rules (lua/limits_pace.lua): what one process
// learned decides the next turn of every process.

const limitsSuffix = "!limits"

// opLearnLimits is the operation that records learned limits, named in
// errors.
const opLearnLimits op = "learn limits"

// limitsKey is subject's hash of learned limits under this limiter's
// rules.
func (p *policy) limitsKey(subject string) string {
	return key(p.prefix, escape(subject), limitsSuffix+"("+strings.Join(p.keyRules, ",")+")")
}

// A LearnedLimit is a limit learned of the resource behind a limiter for
// one of its rules (LearnLimits): the Limit, and how much of it is left
// now if HasRemaining.
type LearnedLimit struct {
	Limit
	Remaining    int
	HasRemaining bool
}

// LearnLimits records, for subject, the limits the resource behind l
// announced, by the name of the rule each binds (an LLM provider's
// requests limit binds the rule counting requests, its input-token limit
// the rule counting input tokens): from then on, for UpstreamTTL after
// the last lesson, every process's Admit and Settle decide a GCRA or
// TokenBucket rule at its learned limit where that is slower (Count per
// Period) or smaller (Burst), never looser than the rule: a learned limit
// above the rule changes nothing, and a learned burst is never taken
// below the cost of the request decided. A limit learned again replaces
// the last; other rules keep theirs. Burst 0 leaves the rule's burst.
// Where HasRemaining, the rule's state is moved, in the same call, so
// that at most Remaining is available now (what the rule's earlier
// requests were charged at its own rate is then counted at the learned
// one).
//
// Errors: a name that is none of l's rules, an invalid limit (Count and
// Period as Limit requires, Burst 0 to Count, Remaining not negative),
// and errors matching ErrRedis if Redis fails.
func (l *Limiter) LearnLimits(ctx context.Context, subject string, learned map[string]LearnedLimit) error {
	if err := l.open(); err != nil {
		return err
	}
	keys, args, err := l.request(opLearnLimits, subject, 1, UpstreamTTL.Milliseconds(), nil)
	if err != nil {
		return err
	}
	keys = append(keys, l.limitsKey(subject))
	for i, r := range l.rules {
		lim, ok := learned[r.Name]
		if !ok {
			continue
		}
		if err := lim.validate(); err != nil {
			return fmt.Errorf("throttle: learn limits: rule %q: %s", r.Name, strings.TrimPrefix(err.Error(), "throttle: "))
		}
		if lim.Burst < 0 || lim.Burst > lim.Count || lim.Remaining < 0 {
			return fmt.Errorf("throttle: learn limits: rule %q: burst %d, remaining %d: the burst must be from 0 (the rule's) to the count, %d, and remaining not negative", r.Name, lim.Burst, lim.Remaining, lim.Count)
		}
		left := -1
		if lim.HasRemaining {
			left = lim.Remaining
		}
		args = append(args, strconv.Itoa(i+1), lim.Count, lim.Period.Microseconds(), lim.Burst, left)
	}
	if n := (len(args) - 3 - 5*len(l.rules)) / 5; n != len(learned) {
		return fmt.Errorf("throttle: learn limits: %d limits given, %d of them for rules of this limiter; name its rules (Limiter.Rules)", len(learned), n)
	}
	if len(learned) == 0 {
		return nil
	}
	_, err = l.exec(ctx, opLearnLimits, l.scripts.learn, keys, args)
	return err
}
