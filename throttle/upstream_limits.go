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

// learnLimitsScript records learned limits: lua/learn_limits.lua.
var learnLimitsScript = buildScript("learn_limits.lua")

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
//
// Errors: a name that is none of l's rules, an invalid limit (Count and
// Period as Limit requires, Burst 0 to Count), and errors matching
// ErrRedis if Redis fails.
func (l *Limiter) LearnLimits(ctx context.Context, subject string, learned map[string]Limit) error {
	if err := l.open(); err != nil {
		return err
	}
	if _, err := encodeSubject(subject); err != nil {
		return err
	}
	args := []any{UpstreamTTL.Milliseconds()}
	for i, r := range l.rules {
		lim, ok := learned[r.Name]
		if !ok {
			continue
		}
		if err := lim.validate(); err != nil {
			return fmt.Errorf("throttle: learn limits: rule %q: %s", r.Name, strings.TrimPrefix(err.Error(), "throttle: "))
		}
		if lim.Burst < 0 || lim.Burst > lim.Count {
			return fmt.Errorf("throttle: learn limits: rule %q: burst %d: must be from 0 (the rule's) to the count, %d", r.Name, lim.Burst, lim.Count)
		}
		args = append(args, strconv.Itoa(i+1), lim.Count, lim.Period.Microseconds(), lim.Burst)
	}
	if len(args) != 1+4*len(learned) {
		return fmt.Errorf("throttle: learn limits: %d limits given, %d of them for rules of this limiter; name its rules (Limiter.Rules)", len(learned), (len(args)-1)/4)
	}
	if len(learned) == 0 {
		return nil
	}
	cmd := l.run(ctx, learnLimitsScript, evalLine([]string{l.limitsKey(subject)}, args))
	return l.result(ctx, opLearnLimits, cmd.Err())
}
