// Line charts on uPlot (vendored), coloured from the page's CSS variables.

/** The colour of CSS variable `name` on the page. */
function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

/** Series colours, in order. */
export function palette() {
  return ["--s1", "--s2", "--s3", "--s4", "--s5", "--s6"].map(cssVar);
}

/**
 * Debiased exponential moving average of `values` with weight `w` in [0, 1).
 * Missing values stay missing and do not move the average.
 */
export function smooth(values, w) {
  if (!w) return values.slice();
  const out = new Array(values.length);
  let avg = 0;
  let n = 0;
  for (let i = 0; i < values.length; i += 1) {
    const v = values[i];
    if (v === null || v === undefined) {
      out[i] = null;
      continue;
    }
    avg = avg * w + (1 - w) * v;
    n += 1;
    out[i] = avg / (1 - w ** n);
  }
  return out;
}

/** Tick spacings of the x axis: whole numbers (1, 2, 5, 10, 20, 50, ...). */
const WHOLE_INCREMENTS = Array.from({ length: 16 }, (_, i) => [1, 2, 5].map((m) => m * 10 ** i)).flat();

/** The x range: from the first to the last value drawn (one unit each side of a single one). */
function wholeRange(u, min, max) {
  if (min === null || max === null) return [0, 1];
  return min === max ? [min - 1, max + 1] : [min, max];
}

/**
 * A chart in `el`. series: [{label, color, width, dash, points, spanGaps}].
 * Returns {setData(data), rebuild(opts), destroy()}; `el._uplot` is the uPlot instance.
 */
export function lineChart(el, { series, xLabel, log = false, height = 260 }) {
  let plot = null;
  let data = [[], ...series.map(() => [])];
  let options = { series, xLabel, log, height };
  let frame = 0;

  function build() {
    if (plot) plot.destroy();
    const fg = cssVar("--fg");
    const grid = cssVar("--grid");
    const axis = { stroke: fg, grid: { stroke: grid }, ticks: { stroke: grid } };
    plot = new uPlot(
      {
        width: Math.max(240, el.clientWidth || 600),
        height: options.height,
        // x is a step or a token count: the data's own range (not uPlot's rounded one,
        // 0-100 for 12 steps) and whole-number ticks only.
        scales: { x: { time: false, range: wholeRange }, y: { distr: options.log ? 3 : 1 } },
        axes: [{ ...axis, label: options.xLabel, incrs: WHOLE_INCREMENTS }, { ...axis, size: 60 }],
        legend: { live: true },
        cursor: { drag: { x: true, y: false } },
        series: [
          { label: options.xLabel },
          ...options.series.map((s) => ({
            label: s.label,
            stroke: s.color,
            width: s.width ?? 1.5,
            dash: s.dash,
            spanGaps: s.spanGaps ?? false,
            points: { show: s.points ?? false, size: 5 },
          })),
        ],
      },
      data,
      el,
    );
    el._uplot = plot;
  }

  build();
  const observer = new ResizeObserver(() => {
    if (plot && el.clientWidth) plot.setSize({ width: Math.max(240, el.clientWidth), height: options.height });
  });
  observer.observe(el);

  return {
    /** Replace the data (x first, then one array per series); drawn on the next frame. */
    setData(next) {
      data = next;
      if (!frame) {
        frame = requestAnimationFrame(() => {
          frame = 0;
          if (plot) plot.setData(data);
        });
      }
    },
    /** Rebuild with changed options (log scale, theme colours). */
    rebuild(changes = {}) {
      options = { ...options, ...changes };
      build();
    },
    destroy() {
      observer.disconnect();
      if (frame) cancelAnimationFrame(frame);
      if (plot) plot.destroy();
      plot = null;
    },
  };
}
