// Prometheus text exposition format → samples, and Prometheus's histogram_quantile over bucket deltas
// (the same arithmetic as izh inspect's izh_cli/inspect_metrics.py).

const LABEL = /\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?/y;

function unescape(text) {
  return text.replace(/\\([\\"n])/g, (_, c) => (c === "n" ? "\n" : c));
}

function parseLabels(text) {
  const labels = {};
  LABEL.lastIndex = 0;
  while (LABEL.lastIndex < text.length) {
    const start = LABEL.lastIndex;
    const match = LABEL.exec(text);
    if (!match || LABEL.lastIndex === start) {
      if (/^\s*$/.test(text.slice(start))) break;
      throw new Error(`bad labels: {${text}}`);
    }
    labels[match[1]] = unescape(match[2]);
  }
  return labels;
}

function parseValue(text) {
  const word = text.trim().split(/\s+/)[0];
  if (word === "+Inf" || word === "Inf") return Infinity;
  if (word === "-Inf") return -Infinity;
  if (word === "NaN") return NaN;
  const value = Number(word);
  if (word === "" || Number.isNaN(value)) throw new Error(`bad value: ${text}`);
  return value;
}

/** One scrape: samples by metric name (suffixes such as _bucket and _total kept). */
export class Scrape {
  constructor(text, time) {
    this.time = time;
    this.samples = new Map();
    for (const raw of text.split("\n")) {
      const line = raw.trim();
      if (!line || line.startsWith("#")) continue;
      try {
        let name;
        let labels = {};
        let rest;
        const brace = line.indexOf("{");
        const space = line.search(/\s/);
        if (brace >= 0 && (space < 0 || brace < space)) {
          name = line.slice(0, brace);
          const close = line.lastIndexOf("}");
          labels = parseLabels(line.slice(brace + 1, close));
          rest = line.slice(close + 1);
        } else {
          name = line.slice(0, space);
          rest = line.slice(space);
        }
        const value = parseValue(rest);
        if (!this.samples.has(name)) this.samples.set(name, []);
        this.samples.get(name).push({ labels, value });
      } catch {
        // a line we cannot read is skipped, as izh inspect does
      }
    }
  }

  has(name) {
    return this.samples.has(name);
  }

  /** The sum over every label set, or null when the metric is absent. */
  total(name) {
    const series = this.samples.get(name);
    return series ? series.reduce((sum, s) => sum + s.value, 0) : null;
  }

  mean(name) {
    const series = this.samples.get(name);
    return series && series.length ? this.total(name) / series.length : null;
  }

  byLabel(name, key) {
    const values = {};
    for (const sample of this.samples.get(name) || []) {
      const label = sample.labels[key];
      if (label !== undefined) values[label] = (values[label] || 0) + sample.value;
    }
    return values;
  }

  /** Cumulative [upper bound, count] pairs of a histogram, summed over label sets, sorted by bound. */
  buckets(histogram) {
    const counts = new Map();
    for (const sample of this.samples.get(`${histogram}_bucket`) || []) {
      const le = sample.labels.le;
      if (le === undefined) continue;
      const bound = le === "+Inf" || le === "Inf" ? Infinity : Number(le);
      counts.set(bound, (counts.get(bound) || 0) + sample.value);
    }
    return [...counts.entries()].sort((a, b) => a[0] - b[0]);
  }
}

/** Prometheus's histogram_quantile: linear interpolation inside the bucket holding rank q·N. */
export function histogramQuantile(q, buckets) {
  if (buckets.length < 2 || buckets[buckets.length - 1][0] !== Infinity) return null;
  const total = buckets[buckets.length - 1][1];
  if (total <= 0) return null;
  const rank = q * total;
  const index = buckets.findIndex(([, count]) => count >= rank);
  if (index === buckets.length - 1) return buckets[buckets.length - 2][0];
  const [upper, count] = buckets[index];
  if (index === 0 && upper <= 0) return upper;
  const [lower, below] = index === 0 ? [0, 0] : buckets[index - 1];
  const inBucket = count - below;
  return inBucket > 0 ? lower + (upper - lower) * ((rank - below) / inBucket) : upper;
}

/** Bucket counts observed between two scrapes (a counter reset keeps the current counts). */
export function bucketDelta(current, previous) {
  if (!previous || !previous.length) return current;
  const before = new Map(previous);
  const delta = current.map(([bound, count]) => [bound, count - (before.get(bound) || 0)]);
  return delta.some(([, count]) => count < 0) ? current : delta;
}

/** A counter's rate per second between two values (a reset counts all of the current value). */
export function rate(current, previous, seconds) {
  if (current === null || previous === null || !(seconds > 0)) return null;
  return (current >= previous ? current - previous : current) / seconds;
}
