package main

import (
	"strings"
	"testing"
)

// TestFleetTally checks the busy case's accounting from its records: a
// task never started is lost, one started twice doubled, a parked task's
// lateness is its start after its slot (the one it redeemed, or the one it
// was parked for if it took a new turn), and the other rule's records are
// not counted.
func TestFleetTally(t *testing.T) {
	b := &fleetBusy{Rule: bookedRule, Tasks: 4, PerTenant: 2}
	b.tally([]simRun{
		{Rule: bookedRule, Task: 0, AtUs: 100},                                                           // never parked
		{Rule: bookedRule, Task: 1, Park: true, AtUs: 100, SlotUs: 2_000},                                // parked for 2 ms
		{Rule: bookedRule, Task: 1, Redeemed: true, AtUs: 2_500, SlotUs: 2_000},                          // on its turn, 0.5 ms late
		{Rule: bookedRule, Task: 2, Park: true, AtUs: 100, SlotUs: 3_000},                                // parked for 3 ms
		{Rule: bookedRule, Task: 2, AtUs: 7_000},                                                         // back 4 ms late: a new turn
		{Rule: bookedRule, Task: 2, AtUs: 8_000},                                                         // and again: doubled
		{Rule: linedRule, Task: 3, AtUs: 100},                                                            // another case's
		{Rule: bookedRule, Task: 3, Park: true, InLine: true, AtUs: 100, SlotUs: 9_000, Redeemed: false}, // never started
	})
	got := []int64{b.Runs, int64(b.Lost), int64(b.Doubled), b.ParkedTasks, b.Straight, b.Redeemed, b.NewTurn}
	want := []int64{4, 1, 1, 3, 1, 1, 1}
	for i, name := range []string{"runs", "lost", "doubled", "parked", "never parked", "redeemed", "new turn"} {
		if got[i] != want[i] {
			t.Errorf("%s = %d, want %d", name, got[i], want[i])
		}
	}
	if b.LateP50Ms != 0.5 || b.LateMaxMs != 4 {
		t.Errorf("lateness p50 %v ms, max %v ms; want 0.5 and 4", b.LateP50Ms, b.LateMaxMs)
	}
	if len(b.LostExamples) != 1 || !strings.HasPrefix(b.LostExamples[0], "task 3 (tenant 1)") {
		t.Errorf("lost examples %q, want task 3's", b.LostExamples)
	}
}

// TestReplaceFleetSection checks that the fleet section replaces its
// former self up to the next section, or is appended.
func TestReplaceFleetSection(t *testing.T) {
	cases := []struct{ name, md, want string }{
		{"appended", "# B\n\n## One\n\ntext\n", "# B\n\n## One\n\ntext\n\nNEW"},
		{"last", "# B\n\n" + fleetHeading + "\n\nold\n", "# B\n\nNEW"},
		{"middle", "# B\n\n" + fleetHeading + "\n\nold\n\n## Next\n", "# B\n\nNEW## Next\n"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := replaceFleetSection(c.md, "NEW"); got != c.want {
				t.Errorf("got %q, want %q", got, c.want)
			}
		})
	}
}
