// The operator page's charts: the last hour of this proxy in 10-second steps
// (/page/series), drawn with uPlot (static/uPlot.iife.min.js, kept beside this file)
// and asked for again every 10 s. One clock, UTC and 24-hour; every value with its
// unit. Without this script the page is its tables, and the charts stay hidden.
"use strict";

(() => {
  const REFRESH = 10000; // ms: a bucket's length
  const HEIGHT = 240;
  const box = document.getElementById("charts");
  const status = document.getElementById("charts-status");
  if (!box || typeof uPlot === "undefined") {
    return;
  }
  box.hidden = false;

  const pad = (n) => String(n).padStart(2, "0");
  // HH:MM, or HH:MM:SS, of a Unix time in seconds, in UTC.
  function clock(at, seconds) {
    const d = new Date(at * 1000);
    const hhmm = `${pad(d.getUTCHours())}:${pad(d.getUTCMinutes())}`;
    return seconds ? `${hhmm}:${pad(d.getUTCSeconds())}` : hhmm;
  }
  // Three significant digits, never an exponent.
  const number = (v) => (v >= 100 ? v.toFixed(0) : String(Number(v.toPrecision(3))));
  function duration(s) {
    if (s >= 1) {
      return `${number(s)} s`;
    }
    return s >= 0.001 ? `${number(s * 1000)} ms` : `${number(s * 1e6)} µs`;
  }
  const shown = (format) => (u, v) => (v == null ? "-" : format(v));
  const ticks = (format) => (u, splits) => splits.map((v) => (v == null ? "" : format(v)));

  const DECISIONS = { forwarded: "#1b5e20", replayed: "#1565c0", refused: "#b00020" };
  const KINDS = ["#b00020", "#e65100", "#6a1b9a", "#ad1457", "#4e342e", "#00838f", "#827717"];
  const PARTS = {
    total: ["through the proxy", "#0d47a1"],
    store: ["in the store", "#6a1b9a"],
    upstream: ["at the upstream", "#e65100"],
  };
  // The mean dashed over the largest: where they are one, both show.
  const BATCHES = { largest: ["largest", "#5d4037"], mean: ["mean", "#00838f", [6, 4]] };

  // A single point among gaps has no line to draw: draw it as a dot.
  function lonely(u, i, show) {
    if (show) {
      return null;
    }
    const ys = u.data[i];
    const found = [];
    for (let n = 0; n < ys.length; n++) {
      if (ys[n] != null && ys[n - 1] == null && ys[n + 1] == null) {
        found.push(n);
      }
    }
    return found.length ? found : null;
  }

  function line(label, values, stroke, format, dash) {
    return {
      label,
      values,
      stroke,
      width: 2,
      dash,
      value: shown(format),
      points: { size: 6, fill: stroke, filter: lonely },
    };
  }

  // What each chart draws from /page/series: its lines and its y axis.
  function charts(data) {
    const rate = (v) => `${number(v)}/s`;
    const ops = (v) => number(v);
    const seconds = [];
    for (const [part, [label, colour]] of Object.entries(PARTS)) {
      const { p50, p99 } = data.seconds[part];
      seconds.push(line(`${label} p99`, p99, colour, duration));
      seconds.push(line(`${label} p50`, p50, colour, duration, [6, 4]));
    }
    return {
      "chart-decisions": {
        y: "writes per second",
        format: number,
        lines: Object.entries(DECISIONS).map(([name, colour]) =>
          line(name, data.decisions[name], colour, rate),
        ),
      },
      "chart-refusals": {
        y: "refusals per second",
        format: number,
        lines: Object.keys(data.refusals).map((kind, n) =>
          line(kind, data.refusals[kind], KINDS[n % KINDS.length], rate),
        ),
      },
      "chart-seconds": { y: "time, log scale", format: duration, log: true, lines: seconds },
      "chart-batches": {
        y: "operations per commit",
        format: ops,
        lines: Object.entries(BATCHES).map(([name, [label, colour, dash]]) =>
          line(label, data.batches[name], colour, ops, dash),
        ),
      },
    };
  }

  const powerOfTen = (v) => (Math.abs(Math.log10(v) % 1) < 1e-9 ? v : null);

  // Whole powers of ten around the values; 100 µs to 1 s before there are any.
  function logRange(min, max) {
    if (min == null || max == null || !Number.isFinite(min) || !Number.isFinite(max)) {
      return [1e-4, 1];
    }
    return [10 ** Math.floor(Math.log10(min)), 10 ** Math.ceil(Math.log10(max * 1.01))];
  }

  function options(chart, width) {
    return {
      width,
      height: HEIGHT,
      tzDate: (at) => uPlot.tzDate(new Date(at * 1000), "Etc/UTC"),
      scales: {
        x: { time: true },
        y: chart.log
          ? { distr: 3, log: 10, range: (u, min, max) => logRange(min, max) }
          : { range: (u, min, max) => [0, Math.max(max || 0, 1) * 1.1] },
      },
      axes: [
        { label: "time (UTC)", values: ticks((t) => clock(t)) },
        {
          label: chart.y,
          values: ticks(chart.format),
          size: 70,
          // On a log scale, a line at each power of ten only: the ticks between are
          // unlabelled, and a line at each would crowd the chart.
          grid: chart.log ? { filter: (u, splits) => splits.map(powerOfTen) } : {},
        },
      ],
      series: [
        { label: "time (UTC)", value: shown((t) => clock(t, true)) },
        ...chart.lines.map(({ values, ...rest }) => rest),
      ],
    };
  }

  const drawn = {}; // chart id -> {plot, labels}

  function draw(data) {
    for (const [id, chart] of Object.entries(charts(data))) {
      const target = document.getElementById(id);
      const labels = chart.lines.map((l) => l.label).join("\n");
      const values = [data.at, ...chart.lines.map((l) => l.values)];
      const was = drawn[id];
      if (was && was.labels === labels) {
        was.plot.setData(values);
        continue;
      }
      was?.plot.destroy(); // the lines changed (a new kind of refusal): drawn anew
      const plot = new uPlot(options(chart, target.clientWidth), values, target);
      drawn[id] = { plot, labels };
    }
  }

  async function refresh() {
    try {
      const answer = await fetch("/page/series", { cache: "no-store" });
      if (!answer.ok) {
        throw new Error(`the admin listener answered ${answer.status}`);
      }
      draw(await answer.json());
      status.textContent = "";
    } catch (error) {
      status.textContent = `charts not updating: ${error.message}`;
    }
    setTimeout(refresh, REFRESH);
  }

  window.addEventListener("resize", () => {
    for (const [id, { plot }] of Object.entries(drawn)) {
      plot.setSize({ width: document.getElementById(id).clientWidth, height: HEIGHT });
    }
  });
  refresh();
})();
