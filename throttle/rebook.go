package throttle

import (
	"context"
	"strconv"
	"strings"
)

// Rebook books a Redeemed or Granted turn of Admit (again), under the ID
// its caller comes back with (AdmitRequest BookAs, else ID), when the
// caller stops before its slot without acting (a worker draining for
// shutdown puts its task back in the queue; admission.Stack parks a job
// whose turns of several limiters meet later): the caller then redeems
// the same turn when it comes back within the request's Tolerance of the
// slot, instead of taking a new one and leaving this one unused. It
// A booking under a calendar quota is kept as long as the quota's window,
// so that if its caller never redeems it, the policy's next Admit or
// Prepay finds it lapsed and gives its unit back (as a booking of Admit's
// own). It reports whether the turn was booked: false for a reservation that is
// not such a turn with an ID to book under (nor one under a ShareLimit),
// a Granted turn due at once, one whose slot has passed, or one whose ID already holds a booking. Of Rebook and Cancel, only the first call acts (a Redeemed
// turn's Cancel gives nothing back), and a second returns its error.
// It returns an error matching ErrRedis if Redis fails.
func (r *Reservation) Rebook(ctx context.Context) (bool, error) {
	var ok bool
	r.once.Do(func() { ok, r.cancelErr = r.rebook(ctx) })
	return ok, r.cancelErr
}

// rebook is Rebook's one script call.
func (r *Reservation) rebook(ctx context.Context) (bool, error) {
	if r.rebookAs == "" || r.tickets == nil || (!r.spent && r.delay <= 0) {
		// (A Granted turn due at once is the caller's now: nothing to keep.)
		return false, nil
	}
	l := r.lim
	keys := []string{l.receiptsKey(r.subject), l.ticketsKey(r.subject)}
	for i, rule := range l.rules {
		if rule.Algorithm == CalendarWindow {
			// So that a booking that lapses is kept to give its unit back.
			keys = append(keys, key(l.prefix, escape(r.subject), l.keyRules[i]))
		}
	}
	// As admit.lua keeps a booking's: its costs last, which a lapse gives
	// back (lua/rules.lua: lapse_turn).
	costs := strconv.Itoa(r.n)
	if r.per != nil {
		costs = r.per.arg()
	}
	tickets := strings.Join(r.tickets, "\n") + "\n" + strconv.FormatInt(r.booked, 10) + " " + costs
	args := []any{opRebook.arg(), r.rebookAs, r.slot.UnixMicro(), r.tol, tickets}
	cmd, err := l.exec(ctx, opRebook, rebookScript, keys, args)
	if err != nil {
		return false, err
	}
	n, _ := cmd.Int64()
	return n == 1, nil
}

// rebookScript is prelude.lua + rebook.lua; see rebook.lua for KEYS and
// ARGV.
var rebookScript = buildScript("prelude.lua", "rebook.lua")
