package throttle

import (
	"fmt"
	"time"
)

// A policy is a limiter's rules as the policy scripts see them: each
// rule's key name and arguments, and the script that decides them all
// (each lua/<operation>.lua documents its KEYS, ARGV and reply).
type policy struct {
	rules     []Rule
	prefix    string
	keyRules  []string      // escaped rule names, the last part of each key
	lineName  string        // escaped Options.Line: the line's name, if not the rules' (lineKeys)
	ruleArgs  []any         // per rule: algorithm, count, period µs, extra; a ticket follows each
	scripts   *scriptSet    // one per operation (scripts.go)
	tolerance time.Duration // Admit's default: the tightest rate rule's interval, in [1ms, 1s]
	buckets   bool          // every rule is a bucket: WaitN reserves; else window waits queue (window.go)
	holders   bool          // a rule has places (Concurrency): callers need a Waiter, and there is no line
	fast      bool          // allow and reserve go to the fast bucket script (fastRule, scripts.go)
}

// newPolicy validates rules and builds their arguments; the script is
// chosen by New, once it knows the rules are over one subject.
func newPolicy(prefix string, rules []Rule) (policy, error) {
	p := policy{rules: append([]Rule(nil), rules...), prefix: prefix, buckets: true, tolerance: time.Second}
	if p.prefix == "" {
		p.prefix = DefaultPrefix
	}
	seen := map[string]bool{}
	for i, r := range p.rules {
		if err := r.Validate(); err != nil {
			return p, err
		}
		r = r.normal()
		p.rules[i] = r
		if seen[r.Name] {
			return p, &ConfigError{Rule: r.Name, Field: "name", Reason: "is used by two rules of one limiter; rule names must be unique"}
		}
		seen[r.Name] = true
		spec := r.Algorithm.spec()
		extra := int64(r.Limit.Burst)
		if spec.extra != nil {
			extra = spec.extra(r)
		}
		count, period := int64(r.Limit.Count), r.Limit.Period.Microseconds()
		if spec.bucket {
			count, period = lowestTerms(count, period) // bucket.lua: exact times
		}
		p.keyRules = append(p.keyRules, escape(r.Name))
		p.ruleArgs = append(p.ruleArgs, string(r.Algorithm), count, period, extra)
		p.buckets = p.buckets && spec.bucket
		p.holders = p.holders || spec.holders
		if !spec.holders { // a Concurrency rule's Period is a lease, not a rate
			p.tolerance = min(p.tolerance, r.Limit.interval())
		}
	}
	p.tolerance = max(p.tolerance, time.Millisecond)
	if len(p.rules) == 1 {
		count, period, extra := p.ruleArgs[1].(int64), p.ruleArgs[2].(int64), p.ruleArgs[3].(int64)
		p.fast = fastRule(p.rules[0].Algorithm, count, period, extra)
	}
	return p, nil
}

// op is an operation of a policy script (ARGV[1], scripts.go), or another call the
// limiter makes; it names the call in errors.
type op string

const (
	opAllow   op = "allow"   // take n now, or nothing
	opReserve op = "reserve" // book the earliest slot within a bound
	opMeet    op = "meet"    // reserve at a given turn or later (subjects.go)
	opPrepay  op = "prepay"  // reserve, and record a receipt for it
	opAdmit   op = "admit"   // redeem a booking or receipt, or take a new turn (admit.go)
	opAtMost  op = "atmost"  // take what there is, up to n (state.go)
	opRefund  op = "refund"  // give reservations back (refund.go)
	opUndo    op = "undo"    // refund, even after the time to act (subjects.go)
	opPause   op = "pause"   // hold every rule back until a time (pause.go)
	opRenew   op = "renew"   // renew the leases of held places (lease.lua, concurrency.go)
	opRelease op = "release" // give places back (lease.lua, concurrency.go)

	opPaused      op = "paused"       // read a pause (paused.lua)
	opReset       op = "reset"        // forget a subject's state (state.go, reset.lua)
	opDropReceipt op = "drop receipt" // ZREM a cancelled receipt (prepay.go)
	opRebook      op = "rebook"       // book a redeemed turn again (rebook.go)
)

// failsOpen reports whether a failed call for o may be admitted anyway
// (Options.FailOpen): its caller decides, and reports the error then.
func (o op) failsOpen() bool {
	return o == opAllow || o == opReserve || o == opMeet || o == opAdmit || o == opAtMost
}

// unbounded is the bound (ARGV[3]) the scripts read as none: a reserve
// may book any slot.
const unbounded int64 = -1

// noBound is unbounded, boxed once: boxing an int64 outside 0..255
// allocates, and allow sends it on every call.
var noBound any = unbounded

// request is one call's keys and arguments: the operation, n permits for
// subject, the bound in µs (unbounded for none), and for a refund each
// rule's ticket.
func (p *policy) request(o op, subject string, n int, bound int64, tickets []string) ([]string, []any, error) {
	line, err := p.build(o, subject, n, bound, tickets == nil)
	if err != nil {
		return nil, nil, err
	}
	keys, args := lineCall(line)
	for i, t := range tickets {
		args[3+5*i+4] = t
	}
	return keys, args, nil
}

// line is request without tickets, as the script call's line (run.go),
// built in one allocation: Allow's.
func (p *policy) line(o op, subject string, n int, bound int64) ([]any, error) {
	return p.build(o, subject, n, bound, true)
}

// build builds a call's line: for the fast bucket script if the policy
// and the operation allow it and fast is set (fastScript, scripts.go),
// else allow.lua's, its tickets empty.
func (p *policy) build(o op, subject string, n int, bound int64, fast bool) ([]any, error) {
	enc, err := p.check(subject, n)
	if err != nil {
		return nil, err
	}
	k := len(p.rules)
	if fast && p.fast && (o == opAllow || o == opReserve) {
		return fastLine(key(p.prefix, enc, p.keyRules[0]), o, n, bound, p.ruleArgs[2], p.ruleArgs[3]), nil
	}
	line := newLine(k, 3+5*k)
	args := line[lineHead+k:]
	args[0], args[1], args[2] = o.arg(), n, boundArg(bound)
	for i := range k {
		line[lineHead+i] = key(p.prefix, enc, p.keyRules[i])
		copy(args[3+5*i:], p.ruleArgs[4*i:4*i+4])
		args[3+5*i+4] = ""
	}
	return line, nil
}

// fastLine is the line of a call of the fast bucket script (scripts.go)
// on key: op, n, the rule's interval in µs and its burst, then a
// reserve's bound. An allow sends no bound: it never waits, and each
// argument costs Redis an object and a Lua string per call.
func fastLine(key string, o op, n int, bound int64, interval, burst any) []any {
	nargs := fastArgs
	if o == opAllow {
		nargs--
	}
	line := newLine(1, nargs)
	line[lineHead] = key
	args := line[lineHead+1:]
	args[0], args[1], args[2], args[3] = o.arg(), n, interval, burst
	if o != opAllow {
		args[4] = boundArg(bound)
	}
	return line
}

// check validates a request of n permits for subject and returns the
// subject's encoded form.
func (p *policy) check(subject string, n int) (string, error) {
	if n < 0 {
		return "", fmt.Errorf("throttle: n = %d permits: must not be negative (0 reads the state)", n)
	}
	for _, r := range p.rules {
		if c := r.Limit.capacity(r.Algorithm); n > c {
			return "", capacityError(r.Name, n, c)
		}
	}
	return encodeSubject(subject)
}

// boundArg is a bound (ARGV[3]) as sent; unbounded without boxing.
func boundArg(bound int64) any {
	if bound == unbounded {
		return noBound
	}
	return bound
}

// answerOnly is the op argument (ARGV[1]) of a fast-script allow whose
// caller keeps only its Result (AllowN): lua/bucket_fast.lua answers it
// with one integer (compactResult, replies.go) instead of the array, and
// allowLine (scripts.go) sends it to allow.lua as an allow.
var answerOnly any = "a"

// arg is o as a script argument (ARGV[1]), boxed without allocating for
// the hot operations.
func (o op) arg() any {
	switch o {
	case opAllow:
		return "allow"
	case opReserve:
		return "reserve"
	}
	return string(o)
}
