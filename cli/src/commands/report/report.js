// gpualloc report: draws the charts from the JSON in the page's
// script.gpualloc-data elements (one per trace: a page may show several ranks).
// Everything here is inline in the page; nothing is fetched.
//
// Per device: the memory chart (reserved, allocated, active; min-max bands
// per bucket, phase spans shaded, OOMs and layout moments marked), the
// fragmentation chart on the same time axis, the layout at a clicked moment
// and the per-step peaks. Wheel or the buttons zoom, dragging pans, a
// double click resets. The data's times are counted from the device's first
// event (its `t0`, ns after the trace began); every time shown is on the
// trace's clock, as the command line's (`summary`, `replay`), and every label
// of one axis uses one unit.
//
// With #selftest in the address, the page drives itself (zoom, pan, hover,
// click) and writes the outcome into #selftest-result; #view=START-END (ns
// on the trace's clock) opens it zoomed.
'use strict';
(function () {
  const errors = [];
  function showError(msg) {
    errors.push(msg);
    const el = document.getElementById('js-errors');
    if (el) { el.hidden = false; el.textContent += msg + '\n'; }
  }
  window.addEventListener('error', (e) => showError('error: ' + e.message + ' (line ' + e.lineno + ')'));
  window.addEventListener('unhandledrejection', (e) => showError('unhandled rejection: ' + e.reason));

  const PAL = ['#4e79a7', '#f28e2c', '#e15759', '#76b7b2', '#59a14f', '#edc949', '#af7aa1', '#ff9da7', '#9c755f', '#bab0ab'];
  const C = { reserved: '#e15759', allocated: '#4e79a7', active: '#f28e2c', ext: '#af7aa1', unal: '#59a14f', ckpt: 'rgba(242,142,44,0.18)', span: 'rgba(120,120,120,0.10)', oom: '#c00' };
  const M = { l: 78, r: 12, t: 10, b: 26 };

  // One call per trace on the page (one per rank, their element ids
  // prefixed with P); returns the trace's devices.
  function build(DATA, P) {
    const NAMES = DATA.names;

    function phaseName(id) { return id < 0 ? '(no phase)' : (NAMES[id] !== undefined ? NAMES[id] : '#' + id); }
    function phaseColor(id) { return id < 0 ? '#bab0ab' : PAL[id % PAL.length]; }
    function isCheckpoint(name) { return /checkpoint|save|ckpt/i.test(name); }
    function esc(s) { return String(s).replace(/[&<>"]/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;' })[c]); }

    function fmtBytes(b) {
      const u = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
      let v = b, k = 0;
      while (v >= 1024 && k < u.length - 1) { v /= 1024; k++; }
      return k === 0 ? Math.round(b) + ' B' : v.toFixed(2) + ' ' + u[k];
    }
    function pct(x) { return (x * 100).toFixed(1) + '%'; }
    // One unit per axis, chosen from the span shown.
    function timeUnit(span) {
      if (span >= 2e9) return [1e9, 's'];
      if (span >= 2e6) return [1e6, 'ms'];
      if (span >= 2e3) return [1e3, 'us'];
      return [1, 'ns'];
    }
    function niceStep(raw) {
      const p = Math.pow(10, Math.floor(Math.log10(raw)));
      const f = raw / p;
      return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * p;
    }
    function fmtTime(t, unit, step) {
      const d = Math.max(0, Math.min(6, -Math.floor(Math.log10(step / unit[0]) + 1e-9)));
      return (t / unit[0]).toFixed(d) + ' ' + unit[1];
    }
    function fmtTimeAuto(t) {
      const u = timeUnit(Math.max(t, 1) * 2), v = t / u[0];
      return v.toFixed(u[0] === 1 ? 0 : v >= 100 ? 1 : v >= 10 ? 2 : 3) + ' ' + u[1];
    }
    // Byte ticks: 1, 2 or 5 times a power of ten of B, KiB, MiB, GiB or TiB.
    function byteStep(max) {
      const raw = max / 4;
      for (const u of [1, 1024, 1048576, 1073741824, 1099511627776]) {
        for (const m of [1, 2, 5, 10, 20, 50, 100, 200, 500]) if (u * m >= raw) return u * m;
      }
      return raw;
    }

    function makeCanvas(box, h) {
      const c = document.createElement('canvas');
      const dpr = window.devicePixelRatio || 1;
      const w = Math.max(300, box.clientWidth || 900);
      c.width = w * dpr; c.height = h * dpr; c.style.height = h + 'px';
      const ctx = c.getContext('2d');
      ctx.scale(dpr, dpr);
      box.appendChild(c);
      return { c, ctx, w, h };
    }
    function legend(box, items) {
      const d = document.createElement('div');
      d.className = 'legend';
      d.innerHTML = items.map((x) => '<span><i style="background:' + x[1] + '"></i>' + esc(x[0]) + '</span>').join('');
      box.appendChild(d);
      return d;
    }
    function tipAt(box, tip, x, y, html) {
      tip.innerHTML = html; tip.hidden = false;
      const bw = box.clientWidth;
      tip.style.left = Math.min(x + 14, bw - tip.offsetWidth - 4) + 'px';
      tip.style.top = Math.max(0, y - 10) + 'px';
    }

    // ---- One device: shared view, charts, interactions. ----
    function Device(dev) {
      this.d = dev;
      this.view = { x0: 0, x1: Math.max(dev.end, 1) };
      this.charts = [];
      this.picked = null;
      this.main = { start: 0, width: dev.width, series: dev.series };
      this.minWidth = Math.min(dev.width, ...(dev.windows || []).map((w) => w.width));
    }
    // The finest series covering the view: a detail window when zoomed in
    // around a peak or an OOM, else the whole run's.
    Device.prototype.source = function () {
      const v = this.view;
      let best = this.main;
      for (const w of this.d.windows || []) {
        const end = w.start + w.width * w.series.alloc_max.length;
        if (w.start <= v.x0 && v.x1 <= end && w.width < best.width) best = w;
      }
      return best;
    };
    Device.prototype.redraw = function () { for (const ch of this.charts) ch.draw(); };
    Device.prototype.setView = function (x0, x1) {
      const end = Math.max(this.d.end, 1);
      const minSpan = Math.max(this.minWidth * 4, 1);
      let span = Math.max(minSpan, Math.min(end, x1 - x0));
      x0 = Math.max(0, Math.min(end - span, x0));
      this.view = { x0, x1: x0 + span };
      this.redraw();
    };
    Device.prototype.zoomAt = function (t, factor) {
      const v = this.view;
      this.setView(t - (t - v.x0) * factor, t + (v.x1 - t) * factor);
    };
    Device.prototype.reset = function () { this.setView(0, this.d.end); };
    Device.prototype.bucketAt = function (t, src) {
      const n = src.series.alloc_max.length;
      return Math.max(0, Math.min(n - 1, Math.floor((t - src.start) / src.width)));
    };
    Device.prototype.spansAt = function (t) {
      return this.d.spans.filter((s) => s[1] <= t && t <= s[2]);
    };

    // x axis (time) shared by the time charts.
    // Ticks at round times of the trace's clock, `t0` after the data's.
    function timeAxis(ctx, w, h, v, t0) {
      const span = v.x1 - v.x0, unit = timeUnit(span), step = niceStep(span / 7);
      const sx = (t) => M.l + (t - v.x0) / span * (w - M.l - M.r);
      ctx.fillStyle = '#444'; ctx.font = '11px sans-serif'; ctx.textAlign = 'center';
      ctx.strokeStyle = '#eee';
      for (let t = Math.ceil((v.x0 + t0) / step) * step; t <= v.x1 + t0; t += step) {
        const x = sx(t - t0);
        ctx.beginPath(); ctx.moveTo(x, M.t); ctx.lineTo(x, h - M.b); ctx.stroke();
        ctx.fillText(fmtTime(t, unit, step), x, h - 8);
      }
      return sx;
    }
    function yAxis(ctx, w, h, ymax, fmt, stepFn) {
      const sy = (y) => h - M.b - y / ymax * (h - M.b - M.t);
      const step = stepFn(ymax);
      ctx.textAlign = 'right'; ctx.fillStyle = '#444'; ctx.strokeStyle = '#e4e4e4';
      for (let y = 0; y <= ymax * 1.0001; y += step) {
        ctx.beginPath(); ctx.moveTo(M.l, sy(y)); ctx.lineTo(w - M.r, sy(y)); ctx.stroke();
        ctx.fillText(fmt(y), M.l - 5, sy(y) + 4);
      }
      return sy;
    }
    function attachZoom(dv, canvas, sxInv) {
      let drag = null;
      canvas.addEventListener('wheel', (e) => {
        e.preventDefault();
        dv.zoomAt(sxInv(e), e.deltaY < 0 ? 0.7 : 1 / 0.7);
      }, { passive: false });
      canvas.addEventListener('mousedown', (e) => { drag = { x: e.clientX, v: dv.view, moved: false }; });
      window.addEventListener('mouseup', () => { setTimeout(() => { drag = null; }, 0); });
      canvas.addEventListener('mousemove', (e) => {
        if (!drag || !(e.buttons & 1)) return;
        const w = canvas.getBoundingClientRect().width - M.l - M.r;
        const dt = (e.clientX - drag.x) / w * (drag.v.x1 - drag.v.x0);
        if (Math.abs(e.clientX - drag.x) > 3) drag.moved = true;
        dv.setView(drag.v.x0 - dt, drag.v.x1 - dt);
      });
      canvas.addEventListener('dblclick', () => dv.reset());
      return () => drag && drag.moved;
    }
    function toolbar(dv, box) {
      const tb = document.createElement('div');
      tb.className = 'toolbar';
      tb.innerHTML = '<button data-z="in" title="zoom in">+</button><button data-z="out" title="zoom out">&minus;</button>' +
        '<button data-z="reset">reset</button><span class="note">wheel: zoom, drag: pan, double click: reset, click: memory at that moment</span>' +
        '<span class="view"></span>';
      tb.addEventListener('click', (e) => {
        const z = e.target.getAttribute && e.target.getAttribute('data-z');
        const mid = (dv.view.x0 + dv.view.x1) / 2;
        if (z === 'in') dv.zoomAt(mid, 0.5);
        if (z === 'out') dv.zoomAt(mid, 2);
        if (z === 'reset') dv.reset();
      });
      box.appendChild(tb);
      return tb.querySelector('.view');
    }

    function memoryChart(dv, box) {
      const d = dv.d;
      const viewLabel = toolbar(dv, box);
      const items = [['reserved (min-max per bucket)', C.reserved], ['allocated', C.allocated]];
      items.push(d.active_differs ? ['active (allocated + freed blocks awaiting stream events), dashed', C.active]
        : ['active: equal to allocated throughout (no freed block waited on a stream)', C.active]);
      if (d.spans.length) items.push(['checkpoint spans', 'rgba(242,142,44,0.5)'], ['other rare phases', 'rgba(120,120,120,0.3)']);
      if (d.snapshots.some((x) => x.kind === 'oom')) items.push(['OOM', C.oom]);
      items.push(['recorded layouts (click near one)', '#333']);
      legend(box, items);
      const cv = makeCanvas(box, 300);
      const tip = document.createElement('div'); tip.className = 'tip'; tip.hidden = true; box.appendChild(tip);
      const inv = (e) => {
        const r = cv.c.getBoundingClientRect();
        const x = e.clientX - r.left;
        return dv.view.x0 + (x - M.l) / (r.width - M.l - M.r) * (dv.view.x1 - dv.view.x0);
      };
      const dragged = attachZoom(dv, cv.c, inv);
      const oomT = d.snapshots.filter((x) => x.kind === 'oom').map((x) => x.t);
      const chart = {
        canvas: cv.c, tip,
        draw() {
          const { ctx, w, h } = cv, v = dv.view;
          ctx.clearRect(0, 0, w, h);
          const src = dv.source(), s = src.series, S0 = src.start;
          const b0 = dv.bucketAt(v.x0, src), b1 = dv.bucketAt(v.x1, src);
          let ymax = 1;
          for (let i = b0; i <= b1; i++) ymax = Math.max(ymax, s.res_max[i], s.active_max[i]);
          ymax *= 1.05;
          const sy = yAxis(ctx, w, h, ymax, fmtBytes, byteStep);
          const sx = timeAxis(ctx, w, h, v, d.t0);
          ctx.save(); ctx.beginPath(); ctx.rect(M.l, M.t, w - M.l - M.r, h - M.t - M.b); ctx.clip();
          for (const sp of d.spans) {
            if (sp[2] < v.x0 || sp[1] > v.x1) continue;
            ctx.fillStyle = isCheckpoint(phaseName(sp[0])) ? C.ckpt : C.span;
            const x = sx(sp[1]), sw = Math.max(1, sx(sp[2]) - sx(sp[1]));
            ctx.fillRect(x, M.t, sw, h - M.t - M.b);
            const label = phaseName(sp[0]);
            if (sw > ctx.measureText(label).width + 6) {
              ctx.fillStyle = '#7a4a10'; ctx.textAlign = 'left'; ctx.fillText(label, x + 3, M.t + 11);
            }
          }
          const W = src.width;
          // Step shapes: a bucket's value holds across it; min-max as a band.
          const band = (lo, hi, fill) => {
            ctx.beginPath();
            for (let i = b0; i <= b1; i++) { ctx.lineTo(sx(S0 + i * W), sy(hi[i])); ctx.lineTo(sx(S0 + (i + 1) * W), sy(hi[i])); }
            for (let i = b1; i >= b0; i--) { ctx.lineTo(sx(S0 + (i + 1) * W), sy(lo[i])); ctx.lineTo(sx(S0 + i * W), sy(lo[i])); }
            ctx.closePath(); ctx.fillStyle = fill; ctx.fill();
          };
          const line = (hi, color, dash, width) => {
            ctx.beginPath(); ctx.setLineDash(dash); ctx.strokeStyle = color; ctx.lineWidth = width;
            for (let i = b0; i <= b1; i++) { ctx.lineTo(sx(S0 + i * W), sy(hi[i])); ctx.lineTo(sx(S0 + (i + 1) * W), sy(hi[i])); }
            ctx.stroke(); ctx.setLineDash([]); ctx.lineWidth = 1;
          };
          const zero = s.alloc_min.map(() => 0);
          band(zero, s.alloc_max, 'rgba(78,121,167,0.18)');
          band(s.alloc_min, s.alloc_max, 'rgba(78,121,167,0.35)');
          band(s.res_min, s.res_max, 'rgba(225,87,89,0.25)');
          line(s.res_max, C.reserved, [], 1.6);
          line(s.alloc_max, C.allocated, [], 1.6);
          if (d.active_differs) line(s.active_max, C.active, [5, 3], 1.4);
          for (const t of oomT) {
            ctx.strokeStyle = C.oom; ctx.lineWidth = 2; ctx.beginPath(); ctx.moveTo(sx(t), M.t); ctx.lineTo(sx(t), h - M.b); ctx.stroke(); ctx.lineWidth = 1;
          }
          ctx.fillStyle = '#333';
          for (const sn of d.snapshots) {
            const x = sx(sn.t);
            ctx.beginPath(); ctx.moveTo(x, h - M.b); ctx.lineTo(x - 3, h - M.b - 6); ctx.lineTo(x + 3, h - M.b - 6); ctx.fill();
          }
          if (dv.picked) {
            ctx.strokeStyle = '#000'; ctx.setLineDash([2, 2]);
            ctx.beginPath(); ctx.moveTo(sx(dv.picked.t), M.t); ctx.lineTo(sx(dv.picked.t), h - M.b); ctx.stroke(); ctx.setLineDash([]);
          }
          ctx.restore();
          const span = v.x1 - v.x0, u = timeUnit(span), st = niceStep(span / 7);
          viewLabel.textContent = '  showing ' + fmtTime(v.x0 + d.t0, u, st / 10) + ' to ' + fmtTime(v.x1 + d.t0, u, st / 10) +
            ', ' + fmtTimeAuto(W) + ' per bucket' + (src === dv.main ? '' : ' (detail window)');
        },
        hover(t) {
          const src = dv.source(), s = src.series, i = dv.bucketAt(t, src);
          const r = (lo, hi) => lo[i] === hi[i] ? fmtBytes(hi[i]) : fmtBytes(lo[i]) + ' to ' + fmtBytes(hi[i]);
          let html = '<b>' + fmtTimeAuto(d.t0 + src.start + i * src.width) + ' to ' + fmtTimeAuto(d.t0 + src.start + (i + 1) * src.width) + '</b>' +
            '<br><span style="color:' + C.reserved + '">reserved</span> ' + r(s.res_min, s.res_max) +
            '<br><span style="color:' + C.allocated + '">allocated</span> ' + r(s.alloc_min, s.alloc_max) +
            '<br><span style="color:' + C.active + '">active</span> ' + r(s.active_min, s.active_max);
          for (const sp of dv.spansAt(t).slice(0, 3)) html += '<br>in <b>' + esc(phaseName(sp[0])) + '</b> (+' + fmtBytes(Math.max(0, sp[4] - sp[3])) + ' allocated while open)';
          return html;
        },
      };
      cv.c.addEventListener('mousemove', (e) => {
        const r = cv.c.getBoundingClientRect();
        tipAt(box, tip, e.clientX - r.left, e.clientY - r.top + cv.c.offsetTop, chart.hover(inv(e)));
      });
      cv.c.addEventListener('mouseleave', () => { tip.hidden = true; });
      cv.c.addEventListener('click', (e) => { if (!dragged()) pick(dv, inv(e)); });
      dv.charts.push(chart);
      return chart;
    }

    function fragChart(dv, box) {
      const d = dv.d, f = d.frag;
      legend(box, [['external: 1 - largest free range / free bytes', C.ext], ['unallocated: 1 - allocated / reserved', C.unal]]);
      const cv = makeCanvas(box, 180);
      const tip = document.createElement('div'); tip.className = 'tip'; tip.hidden = true; box.appendChild(tip);
      const inv = (e) => {
        const r = cv.c.getBoundingClientRect();
        return dv.view.x0 + (e.clientX - r.left - M.l) / (r.width - M.l - M.r) * (dv.view.x1 - dv.view.x0);
      };
      attachZoom(dv, cv.c, inv);
      const ext = (x) => x[2] === 0 ? 0 : 1 - x[1] / x[2];
      const unal = (x) => x[4] === 0 ? 0 : 1 - Math.min(x[3], x[4]) / x[4];
      const at = (t) => { let k = 0; while (k + 1 < f.length && f[k + 1][0] <= t) k++; return k; };
      const chart = {
        canvas: cv.c, tip,
        draw() {
          const { ctx, w, h } = cv, v = dv.view;
          ctx.clearRect(0, 0, w, h);
          const sy = yAxis(ctx, w, h, 1, pct, () => 0.25);
          const sx = timeAxis(ctx, w, h, v, d.t0);
          ctx.save(); ctx.beginPath(); ctx.rect(M.l, M.t, w - M.l - M.r, h - M.t - M.b); ctx.clip();
          for (const [fn, color] of [[ext, C.ext], [unal, C.unal]]) {
            ctx.beginPath(); ctx.strokeStyle = color; ctx.lineWidth = 1.6;
            for (let k = 0; k < f.length; k++) {
              const next = k + 1 < f.length ? f[k + 1][0] : d.end;
              ctx.lineTo(sx(f[k][0]), sy(fn(f[k]))); ctx.lineTo(sx(next), sy(fn(f[k])));
            }
            ctx.stroke(); ctx.lineWidth = 1;
          }
          ctx.restore();
        },
        hover(t) {
          const x = f[at(t)];
          return '<b>from ' + fmtTimeAuto(d.t0 + x[0]) + '</b><br>external ' + pct(ext(x)) + ' (largest free ' + fmtBytes(x[1]) + ' of ' + fmtBytes(x[2]) + ' free)' +
            '<br>unallocated ' + pct(unal(x)) + ' (' + fmtBytes(x[3]) + ' allocated of ' + fmtBytes(x[4]) + ' reserved)';
        },
      };
      cv.c.addEventListener('mousemove', (e) => {
        const r = cv.c.getBoundingClientRect();
        tipAt(box, tip, e.clientX - r.left, e.clientY - r.top + cv.c.offsetTop, chart.hover(inv(e)));
      });
      cv.c.addEventListener('mouseleave', () => { tip.hidden = true; });
      if (f.length) dv.charts.push(chart);
      else box.innerHTML = '<p class="note">No events.</p>';
      return chart;
    }

    function stepsChart(dv, box) {
      const d = dv.d, st = d.steps;
      if (st.length < 2) {
        box.innerHTML = '<p class="note">No iteration boundaries were recorded (gpualloc.mark calls, or a top-level phase opened repeatedly), so there are no per-step peaks.</p>';
        return null;
      }
      legend(box, [['peak reserved', C.reserved], ['peak allocated', C.allocated]]);
      const note = document.createElement('p'); note.className = 'note';
      note.textContent = (d.steps_per_bar > 1 ? 'Each bar merges ' + d.steps_per_bar + ' consecutive iterations. ' : '') +
        'Iteration 0 is the stretch before the first boundary. Click a bar to zoom the memory chart to it.';
      box.appendChild(note);
      const cv = makeCanvas(box, 200);
      const tip = document.createElement('div'); tip.className = 'tip'; tip.hidden = true; box.appendChild(tip);
      let ymax = 1;
      for (const x of st) ymax = Math.max(ymax, x[4], x[3]);
      ymax *= 1.05;
      const bw = () => (cv.w - M.l - M.r) / st.length;
      const idx = (e) => {
        const r = cv.c.getBoundingClientRect();
        return Math.max(0, Math.min(st.length - 1, Math.floor((e.clientX - r.left - M.l) / ((r.width - M.l - M.r) / st.length))));
      };
      const chart = {
        canvas: cv.c, tip,
        draw() {
          const { ctx, w, h } = cv;
          ctx.clearRect(0, 0, w, h);
          const sy = yAxis(ctx, w, h, ymax, fmtBytes, byteStep);
          const b = bw();
          ctx.textAlign = 'center'; ctx.fillStyle = '#444';
          const every = Math.max(1, Math.ceil(st.length / 10));
          for (let k = 0; k < st.length; k++) {
            const x = M.l + k * b;
            ctx.fillStyle = 'rgba(225,87,89,0.45)'; ctx.fillRect(x, sy(st[k][4]), Math.max(1, b * 0.9), sy(0) - sy(st[k][4]));
            ctx.fillStyle = C.allocated; ctx.fillRect(x + b * 0.15, sy(st[k][3]), Math.max(1, b * 0.6), sy(0) - sy(st[k][3]));
            if (k % every === 0) { ctx.fillStyle = '#444'; ctx.fillText(String(st[k][0]), x + b / 2, h - 8); }
          }
          ctx.textAlign = 'right'; ctx.fillStyle = '#444'; ctx.fillText('iteration', M.l - 5, h - 8);
        },
        hover(k) {
          const x = st[k], last = x[0] + x[1] - 1;
          return '<b>' + (x[1] > 1 ? 'iterations ' + x[0] + ' to ' + last : 'iteration ' + x[0]) + '</b> from ' + fmtTimeAuto(dv.d.t0 + x[2]) +
            '<br>peak reserved ' + fmtBytes(x[4]) + '<br>peak allocated ' + fmtBytes(x[3]);
        },
        zoomTo(k) {
          const end = k + 1 < st.length ? st[k + 1][2] : d.end;
          dv.setView(st[k][2], end);
        },
      };
      cv.c.addEventListener('mousemove', (e) => {
        const r = cv.c.getBoundingClientRect();
        tipAt(box, tip, e.clientX - r.left, e.clientY - r.top + cv.c.offsetTop, chart.hover(idx(e)));
      });
      cv.c.addEventListener('mouseleave', () => { tip.hidden = true; });
      cv.c.addEventListener('click', (e) => chart.zoomTo(idx(e)));
      chart.draw();
      return chart;
    }

    // ---- The layout at a moment: the recorded one nearest to t. ----
    function pick(dv, t) {
      const sn = dv.d.snapshots;
      if (!sn.length) return null;
      let best = sn[0];
      for (const x of sn) if (Math.abs(x.t - t) < Math.abs(best.t - t)) best = x;
      dv.picked = best;
      dv.redraw();
      renderLayout(dv, best, t);
      return best;
    }

    function renderLayout(dv, sn, asked) {
      const box = document.getElementById(P + 'layout-' + dv.d.device);
      const segs = sn.segments, blocks = sn.blocks;
      const rows = segs.map((sg, k) => ({ k, size: sg[1], label: sg[0], sg, blocks: [] }));
      const outside = { k: -1, size: 0, label: 'outside recorded segments', sg: null, blocks: [] };
      for (const b of blocks) {
        if (b[0] >= 0) rows[b[0]].blocks.push(b);
        else outside.blocks.push(b.slice());
      }
      if (outside.blocks.length) {
        const base = Math.min(...outside.blocks.map((b) => b[1]));
        for (const b of outside.blocks) b[1] -= base;
        outside.size = Math.max(...outside.blocks.map((b) => b[1] + b[2]));
        rows.push(outside);
      }
      const MAXROWS = 48;
      let shownRows = rows;
      if (rows.length > MAXROWS) shownRows = rows.slice().sort((a, b) => b.size - a.size).slice(0, MAXROWS);
      const maxSize = Math.max(1, ...shownRows.map((r) => r.size));
      const W = 1000, L = 190, RH = 16, top = 28;
      const H = top + RH * shownRows.length + 8;
      const sx = (b) => b / maxSize * (W - L - 10);
      let svg = '<svg viewBox="0 0 ' + W + ' ' + H + '" role="img" aria-label="segments and live blocks">';
      const step = byteStep(maxSize);
      for (let o = 0; o <= maxSize; o += step) {
        svg += '<line x1="' + (L + sx(o)) + '" x2="' + (L + sx(o)) + '" y1="' + (top - 4) + '" y2="' + (H - 4) + '" stroke="#eee"/>' +
          '<text x="' + (L + sx(o)) + '" y="' + (top - 8) + '" text-anchor="middle" class="seglabel">' + fmtBytes(o) + '</text>';
      }
      svg += '<text x="4" y="' + (top - 8) + '" class="seglabel">segment (size, stream)</text>';
      const phases = new Map();
      shownRows.forEach((r, i) => {
        const y = top + i * RH;
        const lab = r.sg ? r.label + ' ' + fmtBytes(r.size) + (r.sg[3] ? ' exp.' : '') + ' s' + r.sg[2] : r.label;
        svg += '<text x="4" y="' + (y + 11) + '" class="seglabel">' + esc(lab) + '</text>';
        svg += '<rect x="' + L + '" y="' + y + '" width="' + sx(r.size).toFixed(2) + '" height="' + (RH - 4) + '" fill="#f1f1f1" stroke="#999" stroke-width="0.5"><title>' +
          esc((r.sg ? 'segment ' + r.label + ': ' + fmtBytes(r.size) + ', ' + fmtBytes(r.sg[4]) + ' live in ' + r.sg[5] + ' blocks' : r.label)) + '</title></rect>';
        if (r.sg && r.sg[5] > r.blocks.length) {
          const hidden = r.sg[4] - r.blocks.reduce((a, b) => a + b[2], 0);
          const tx = L + sx(r.size) + 4, inside = tx > W - 200;
          svg += '<text x="' + (inside ? W - 4 : tx).toFixed(2) + '" y="' + (y + 11) + '" class="seglabel' + (inside ? ' halo" text-anchor="end' : '') + '">+' + (r.sg[5] - r.blocks.length) +
            ' smaller blocks (' + fmtBytes(hidden) + ') not drawn</text>';
        }
        for (const b of r.blocks) {
          phases.set(b[4], (phases.get(b[4]) || 0) + b[2]);
          const tipText = '+' + fmtBytes(b[1]) + ': ' + fmtBytes(b[2]) + ' (' + fmtBytes(b[3]) + ' requested), ' + phaseName(b[4]) + ', age ' + fmtTimeAuto(b[5]) + ', stream ' + b[7] + (b[6] ? ', freed, awaiting stream events' : '');
          svg += '<rect class="blk" x="' + (L + sx(b[1])).toFixed(2) + '" y="' + (y + 1) + '" width="' + Math.max(0.6, sx(b[2])).toFixed(2) + '" height="' + (RH - 6) +
            '" fill="' + phaseColor(b[4]) + '"' + (sx(b[2]) > 3 ? ' stroke="#fff" stroke-width="0.4"' : '') + (b[6] ? ' fill-opacity="0.35"' : '') + '><title>' + esc(tipText) + '</title></rect>';
        }
      });
      svg += '</svg>';
      const leg = [...phases.entries()].sort((a, b) => b[1] - a[1]).slice(0, 12)
        .map(([p, bytes]) => '<span><i style="background:' + phaseColor(p) + '"></i>' + esc(phaseName(p)) + ' (' + fmtBytes(bytes) + ' drawn)</span>').join('') +
        '<span><i style="background:#f1f1f1;border:1px solid #999"></i>free</span><span><i style="background:#4e79a7;opacity:.35"></i>freed, awaiting stream events</span>';
      const head = '<p><b>At ' + fmtTimeAuto(dv.d.t0 + sn.t) + '</b> (' + esc(sn.kind) + (Math.abs(sn.t - asked) > dv.d.width ? '; the recorded layout nearest to ' + fmtTimeAuto(dv.d.t0 + asked) : '') + '): ' +
        'allocated ' + fmtBytes(sn.allocated) + ', active ' + fmtBytes(sn.active) + ', reserved ' + fmtBytes(sn.reserved) +
        ', free ' + fmtBytes(sn.free) + ' in pieces of at most ' + fmtBytes(sn.largest_free) + '.</p>' +
        '<p class="note">' + shownRows.length + ' of ' + sn.segments_total + ' segments (largest first when not all), ' + blocks.length + ' of ' + sn.blocks_total +
        ' live blocks drawn (the largest). Blocks are coloured by the phase that allocated them; hover one for its details.</p>';
      const top20 = blocks.slice().sort((a, b) => b[2] - a[2]).slice(0, 20);
      let table = '<p class="note">' + top20.length + ' of ' + sn.blocks_total + ' live blocks, largest first.</p><table><tr><th>segment</th><th>offset</th><th>size</th><th>requested</th><th>phase</th><th>age</th><th>state</th></tr>';
      for (const b of top20) {
        table += '<tr><td>' + esc(b[0] >= 0 ? segs[b[0]][0] : '-') + '</td><td>' + fmtBytes(b[1]) + '</td><td>' + fmtBytes(b[2]) + '</td><td>' + fmtBytes(b[3]) +
          '</td><td>' + esc(phaseName(b[4])) + '</td><td>' + fmtTimeAuto(b[5]) + '</td><td>' + (b[6] ? 'awaiting stream' : 'live') + '</td></tr>';
      }
      table += '</table>';
      box.innerHTML = head + '<div class="legend">' + leg + '</div>' + svg + table;
    }

    // ---- Build. ----
    const devices = [];
    for (const dev of DATA.devices) {
      const dv = new Device(dev);
      dv.P = P;
      devices.push(dv);
      const id = dev.device;
      const tl = document.getElementById(P + 'timeline-' + id), fr = document.getElementById(P + 'frag-' + id);
      const stp = document.getElementById(P + 'steps-' + id);
      if (!tl || !fr || !stp) continue;
      if (dev.series.alloc_max.length === 0 || dev.end === 0 && dev.snapshots.length === 0) {
        tl.innerHTML = '<p class="note">No events.</p>';
        continue;
      }
      dv.memory = memoryChart(dv, tl);
      dv.frag = fragChart(dv, fr);
      dv.steps = stepsChart(dv, stp);
      dv.redraw();
      const peak = dev.snapshots.find((x) => x.kind === 'oom') || dev.snapshots.find((x) => x.kind === 'peak allocated');
      if (peak) pick(dv, peak.t);
    }
    return devices;
  }
  const devices = [];
  for (const el of document.querySelectorAll('script.gpualloc-data')) {
    devices.push(...build(JSON.parse(el.textContent), el.dataset.prefix || ''));
  }

  // ---- Self-test (#selftest): drive the page, report into the DOM. ----
  function inked(canvas) {
    const ctx = canvas.getContext('2d');
    const px = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
    let n = 0;
    for (let i = 3; i < px.length; i += 16) if (px[i] > 0) n++;
    return n;
  }
  function fire(canvas, type, t, dv) {
    const r = canvas.getBoundingClientRect();
    const x = r.left + M.l + (t - dv.view.x0) / (dv.view.x1 - dv.view.x0) * (r.width - M.l - M.r);
    const y = r.top + r.height / 2;
    const init = { clientX: x, clientY: y, bubbles: true, cancelable: true };
    canvas.dispatchEvent(type === 'wheel' ? new WheelEvent('wheel', { ...init, deltaY: -100 }) : new MouseEvent(type, init));
  }
  function selftest() {
    const out = { devices: [], errors };
    let ok = true;
    const check = (r, k, v) => { r[k] = v; if (v !== true) ok = false; };
    for (const dv of devices) {
      if (!dv.memory) continue;
      const r = { device: dv.d.device, prefix: dv.P };
      const mc = dv.memory.canvas;
      check(r, 'memory_chart_drawn', inked(mc) > 500);
      check(r, 'frag_chart_drawn', !dv.frag || inked(dv.frag.canvas) > 200);
      const span0 = dv.view.x1 - dv.view.x0;
      const mid = dv.d.end / 2;
      fire(mc, 'wheel', mid, dv);
      const span1 = dv.view.x1 - dv.view.x0;
      check(r, 'wheel_zooms_in', span1 < span0);
      dv.zoomAt(mid, 0.25);
      check(r, 'zoom_narrows_view', dv.view.x1 - dv.view.x0 < span1);
      const x0 = dv.view.x0;
      dv.setView(dv.view.x0 + (dv.view.x1 - dv.view.x0) / 4, dv.view.x1 + (dv.view.x1 - dv.view.x0) / 4);
      check(r, 'pan_moves_view', dv.view.x0 !== x0 || x0 + (dv.view.x1 - dv.view.x0) >= dv.d.end);
      check(r, 'zoomed_chart_drawn', inked(mc) > 500);
      fire(mc, 'mousemove', (dv.view.x0 + dv.view.x1) / 2, dv);
      const tip = dv.memory.tip;
      check(r, 'hover_shows_values', !tip.hidden && /allocated/.test(tip.textContent) && /reserved/.test(tip.textContent));
      r.hover_text = tip.textContent;
      for (const w of dv.d.windows || []) {
        dv.setView(w.start + w.width * 100, w.start + w.width * 600);
        check(r, 'zoom_uses_detail_window', dv.source() === w && inked(mc) > 500);
      }
      dv.reset();
      check(r, 'reset_restores_view', dv.view.x0 === 0 && dv.view.x1 === Math.max(dv.d.end, 1));
      const target = dv.d.snapshots[Math.floor(dv.d.snapshots.length / 2)];
      fire(mc, 'click', target.t, dv);
      const box = document.getElementById(dv.P + 'layout-' + dv.d.device);
      const rects = box.querySelectorAll('svg rect').length;
      r.layout_rects = rects;
      check(r, 'click_shows_layout', dv.picked !== null && rects > 0 && /At /.test(box.textContent));
      check(r, 'click_picks_nearest_layout', dv.picked === target || Math.abs(dv.picked.t - target.t) <= dv.d.width * 2);
      if (dv.frag) {
        fire(dv.frag.canvas, 'mousemove', dv.d.end / 3, dv);
        check(r, 'frag_hover', !dv.frag.tip.hidden && /external/.test(dv.frag.tip.textContent));
      }
      if (dv.steps) {
        check(r, 'steps_chart_drawn', inked(dv.steps.canvas) > 200);
        dv.steps.zoomTo(1);
        check(r, 'step_click_zooms', dv.view.x1 - dv.view.x0 < dv.d.end);
      }
      for (const ch of dv.charts) ch.tip.hidden = true;
      out.devices.push(r);
    }
    if (!out.devices.length) ok = false;
    if (errors.length) ok = false;
    out.pass = ok;
    const el = document.getElementById('selftest-result');
    el.hidden = false;
    el.textContent = (ok ? 'SELFTEST PASS ' : 'SELFTEST FAIL ') + JSON.stringify(out);
    document.title = ok ? 'SELFTEST PASS' : 'SELFTEST FAIL';
  }
  // #view=START-END (ns on the trace's clock) opens every chart zoomed there.
  const m = /^#view=(\d+)-(\d+)$/.exec(location.hash);
  if (m) for (const dv of devices) if (dv.memory) dv.setView(Number(m[1]) - dv.d.t0, Number(m[2]) - dv.d.t0);
  if (location.hash === '#selftest') {
    try { selftest(); } catch (e) { showError('selftest: ' + e.stack); const el = document.getElementById('selftest-result'); el.hidden = false; el.textContent = 'SELFTEST FAIL ' + e; }
  }
})();
