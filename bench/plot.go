package main

import (
	"fmt"
	"image/color"
	"os"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// plotSeries is one panel of the plot.
type plotSeries struct {
	title  string
	counts []int
}

// plotPanels picks the W=256, P=4 scenario of every implementation (at
// burst 10), and x/time/rate's W=256, P=1, as the ideal.
func plotPanels(res *runResult) []plotSeries {
	var out []plotSeries
	for _, im := range impls {
		p := 4
		if !im.Redis {
			p = 1
		}
		for _, s := range res.Scenarios {
			if s.Impl == im.Name && s.Waiters == 256 && s.Procs == p && s.Burst == res.Config.WindowBurst {
				title := fmt.Sprintf("%s — W=256, P=%d", s.Impl, p)
				if s.BurstApplies {
					title += fmt.Sprintf(", burst %d", s.Burst)
				}
				out = append(out, plotSeries{title, s.Series100ms})
			}
		}
	}
	return out
}

// writePlot draws admissions per 100 ms over time, one panel per
// implementation, with the ideal R/10 dashed.
func writePlot(res *runResult, path string) error {
	return drawPanels(plotPanels(res), float64(res.Config.Rate)/10,
		fmt.Sprintf("seconds from the start (a %g s run, then the drain of the Waits still outstanding)", res.Config.DurationS), path)
}

// drawPanels draws admissions per 100 ms, one panel per series, with
// ideal dashed and xLabel under the last; nothing if there is no panel.
func drawPanels(panels []plotSeries, ideal float64, xLabel, path string) error {
	if len(panels) == 0 {
		return nil
	}
	rows := make([][]*plot.Plot, len(panels))
	for i, ps := range panels {
		p := plot.New()
		p.Title.Text = ps.title
		p.Y.Label.Text = "per 100 ms"
		if i == len(panels)-1 {
			p.X.Label.Text = xLabel
		}
		// Bin j covers [j/10, (j+1)/10) s: a post-step line from its start,
		// closed by a point at the last bin's end.
		pts := make(plotter.XYs, len(ps.counts)+1)
		maxY := ideal
		for j, c := range ps.counts {
			pts[j].X = float64(j) / 10
			pts[j].Y = float64(c)
			maxY = max(maxY, float64(c))
		}
		if n := len(ps.counts); n > 0 {
			pts[n] = plotter.XY{X: float64(n) / 10, Y: pts[n-1].Y}
		}
		line, err := plotter.NewLine(pts)
		if err != nil {
			return err
		}
		line.StepStyle = plotter.PostStep
		line.Color = color.RGBA{R: 31, G: 119, B: 180, A: 255}
		ref, err := plotter.NewLine(plotter.XYs{{X: 0, Y: ideal}, {X: float64(len(ps.counts)) / 10, Y: ideal}})
		if err != nil {
			return err
		}
		ref.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		ref.Color = color.RGBA{R: 214, G: 39, B: 40, A: 255}
		p.Add(plotter.NewGrid(), line, ref)
		p.Y.Min, p.Y.Max = 0, maxY*1.1
		p.X.Min = 0
		rows[i] = []*plot.Plot{p}
	}
	const w, hPer = 9 * vg.Inch, 1.9 * vg.Inch
	img := vgimg.New(w, hPer*vg.Length(len(panels)))
	dc := draw.New(img)
	t := draw.Tiles{Rows: len(panels), Cols: 1, PadY: vg.Points(6), PadX: vg.Points(4), PadTop: vg.Points(4), PadBottom: vg.Points(4)}
	canvases := plot.Align(rows, t, dc)
	for i := range rows {
		rows[i][0].Draw(canvases[i][0])
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
