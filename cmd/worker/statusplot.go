package main

import (
	"fmt"
	"math"

	"github.com/jobthrottle/jobthrottle/worker"
)

// The geometry of a rule's plot, in SVG user units: a bar per second, the
// last worker.ActivitySpan left of "now", the next worker.ActivityAhead
// right of it.
const (
	plotLeft   = 40.0 // room for the y axis labels
	plotBar    = 2.0  // one second
	plotTop    = 8.0
	plotHeight = 100.0
	plotBottom = 18.0 // room for the x axis labels
)

// plot is a rule's inline SVG plot: tasks admitted (and parked) each
// second of the span, the turns booked for each second ahead, and the
// tightest limit's average rate.
type plot struct {
	Width, Height float64 // of the whole image
	Left, Top     float64 // where the span starts, and the y of YMax
	Span, Bottom  float64 // the span's width, and the y of zero
	NowX, EndX    float64
	Inner         float64 // the plot's height, Bottom - Top
	YMax          int     // the count at the top of the plot
	Admitted      []bar   // blue, from zero
	Parked        []bar   // orange, stacked on the admitted
	Ahead         []bar   // green, right of now
	LimitY        float64 // the limit's rate; 0 if none is drawn
	Limit         string  // its label
	LimitLabelY   float64
	Sums          [3]int          // admitted, parked, turns ahead, as plotted
	Title         string          // what the plot shows, in words
	Ticks         []plotAxisLabel // along the x axis
}

// bar is one second's bar.
type bar struct{ X, Y, H float64 }

// plotAxisLabel is a label on the x axis.
type plotAxisLabel struct {
	X, Y   float64
	Anchor string // the SVG text-anchor: start, middle, end
	Text   string
}

// plotOf draws a's seconds, against a limit of perSecond tasks a second
// (0: no limit line).
func plotOf(a worker.RuleActivity, perSecond float64) plot {
	past, ahead := float64(len(a.Seconds)), float64(len(a.Ahead))
	p := plot{Left: plotLeft, Top: plotTop, Span: past * plotBar, Bottom: plotTop + plotHeight}
	p.NowX = p.Left + p.Span
	p.EndX = p.NowX + ahead*plotBar
	p.Width, p.Height = p.EndX+4, p.Bottom+plotBottom
	p.Inner = plotHeight
	top := math.Ceil(perSecond * 1.2) // room for the limit's label
	for _, s := range a.Seconds {
		top = max(top, float64(s.Admitted+s.Parked))
	}
	for _, s := range a.Ahead {
		top = max(top, float64(s.Parked))
	}
	p.YMax = int(max(top, 1))
	scale := plotHeight / float64(p.YMax)
	for i, s := range a.Seconds {
		x := plotLeft + float64(i)*plotBar
		if s.Admitted > 0 {
			h := float64(s.Admitted) * scale
			p.Admitted = append(p.Admitted, bar{x, p.Bottom - h, h})
		}
		if s.Parked > 0 {
			base := float64(s.Admitted) * scale
			h := float64(s.Parked) * scale
			p.Parked = append(p.Parked, bar{x, p.Bottom - base - h, h})
		}
		p.Sums[0] += s.Admitted
		p.Sums[1] += s.Parked
	}
	for i, s := range a.Ahead {
		if s.Parked > 0 {
			h := float64(s.Parked) * scale
			p.Ahead = append(p.Ahead, bar{p.NowX + float64(i)*plotBar, p.Bottom - h, h})
		}
		p.Sums[2] += s.Parked
	}
	if perSecond > 0 {
		p.LimitY = p.Bottom - perSecond*scale
		p.LimitLabelY = p.LimitY - 3
		p.Limit = fmt.Sprintf("limit %.3g/s", perSecond)
	}
	labelY := p.Height - 4
	p.Ticks = []plotAxisLabel{{plotLeft, labelY, "start", "-" + worker.ActivitySpan.String()}, {p.NowX, labelY, "middle", "now"}, {p.EndX, labelY, "end", "+" + worker.ActivityAhead.String()}}
	p.Title = fmt.Sprintf("%s: %d tasks admitted and %d parked in the last %v; %d turns booked in the next %v",
		a.Rule, p.Sums[0], p.Sums[1], worker.ActivitySpan, p.Sums[2], worker.ActivityAhead)
	return p
}
