# ruff: noqa: E501 - a page of HTML and script, its lines as a browser reads them
"""The console's page: one HTML document with its style and script inline, nothing fetched from elsewhere.
It polls ``GET /models`` and ``GET /server`` each second and renders them; its forms call the REST API."""

CONSOLE_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>jitserve console</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d2329;background:#fafbfc}
header{background:#1d2329;color:#fff;padding:10px 24px;display:flex;gap:24px;align-items:baseline}
header h1{margin:0;font-size:20px}header a{color:#c9d1d9}#updated{color:#c9d1d9;font-size:12px}
main{padding:8px 24px 40px}h2{font-size:16px;margin:20px 0 6px}h3{font-size:15px;margin:16px 0 4px}
table{border-collapse:collapse;background:#fff;margin:4px 0}
th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:left;vertical-align:top}th{background:#eef1f4}
.cards{display:flex;flex-wrap:wrap;gap:8px;margin:0}.cards div{background:#fff;border:1px solid #d0d7de;
padding:6px 12px}.cards dt{font-size:12px;color:#57606a}.cards dd{margin:0;font-size:17px}
.state-ready{color:#1a7f37;font-weight:600}.state-failed{color:#b42318;font-weight:600}
.state-compiling,.state-admitted{color:#9a6700;font-weight:600}.meta{color:#57606a;font-size:12px}
#error{color:#b42318}form{background:#fff;border:1px solid #d0d7de;padding:8px 12px;display:grid;
grid-template-columns:max-content 1fr;gap:6px 12px;max-width:760px}form button{justify-self:start}
textarea{font:12px monospace;width:100%;min-height:4em}.forms{display:flex;flex-wrap:wrap;gap:16px}
output{white-space:pre-wrap;font:12px monospace;grid-column:1/3;max-height:9em;overflow:auto;display:block}
</style></head>
<body>
<header><h1>jitserve</h1><span id="health" role="status"></span><span id="updated"></span>
<a href="/docs">API docs</a><a href="/metrics">metrics</a></header>
<main>
<p id="error" role="alert"></p>
<div id="status" aria-live="polite"></div>
<h2>Try it</h2>
<div class="forms">
<form id="upload-form">
  <label for="upload-name">Model name</label><input id="upload-name" name="name" required pattern="[A-Za-z0-9][A-Za-z0-9_.-]{0,63}">
  <label for="upload-file">ONNX file</label><input id="upload-file" name="model" type="file" accept=".onnx,.zip,.tar" required>
  <label for="upload-config">Config (JSON, optional)</label><textarea id="upload-config" name="config"></textarea>
  <label for="upload-token">Admin token (not stored)</label><input id="upload-token" type="password" autocomplete="off">
  <label for="upload-replace">Replace a model of that name</label><input id="upload-replace" type="checkbox">
  <button type="submit">Upload</button><span></span>
  <output id="upload-result" for="upload-name"></output>
</form>
<form id="predict-form">
  <label for="predict-model">Model</label><select id="predict-model" required></select>
  <label for="predict-inputs">Inputs (JSON object: input name to nested lists)</label>
  <textarea id="predict-inputs" required>{"x": [[1, 2, 3, 4]]}</textarea>
  <button type="submit">Predict</button><span></span>
  <output id="predict-result" for="predict-model"></output>
</form>
</div>
</main>
<script>
(function () {
  'use strict';
  function esc(v) {
    return String(v == null ? '' : v).replace(/[&<>"']/g, function (c) {
      return {'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;'}[c];
    });
  }
  function mib(b) { return b == null ? '-' : (b / 1048576).toFixed(0) + ' MiB'; }
  function ms(v) { return v == null ? '' : Number(v).toFixed(3); }
  function cards(items) {
    return '<dl class="cards">' + items.map(function (i) {
      return '<div><dt>' + esc(i[0]) + '</dt><dd>' + esc(i[1]) + '</dd></div>';
    }).join('') + '</dl>';
  }
  function axes(model) {
    return Object.keys(model.axes || {}).map(function (name) {
      var a = model.axes[name], p = a.policy || {}, s = a.padding_safety;
      var range = p.min != null ? ' ' + p.min + '..' + p.max : '';
      var verdict = s ? (s.safe ? 'padding safe' : 'padding unsafe') + ': ' + s.reason : 'not probed';
      return esc(name) + ': ' + esc(p.kind + range) + ' (served as ' + esc(a.effective_policy) + '; ' +
        esc(verdict) + ')';
    }).join('<br>');
  }
  function bucketRow(model, b) {
    var latency = Object.keys(b.latency_ms || {}).map(function (e) {
      return esc(e) + ' ' + ms(b.latency_ms[e]);
    }).join('<br>');
    var padded = Object.keys(b.padded_error || {}).map(function (e) {
      return esc(e) + ' ' + Number(b.padded_error[e]).toExponential(1);
    }).join('<br>');
    var tuning = b.tuning ? esc(b.tuning.state) + (b.tuning.trials != null ? ' (' + b.tuning.trials + ' trials)' : '') : '';
    var explain = b.compile_seconds != null ?
      '<a href="/models/' + encodeURIComponent(model.name) + '/buckets/' + encodeURIComponent(b.bucket) +
      '/explain.html">explain</a>' : '';
    return '<tr><td><code>' + esc(b.bucket) + '</code></td><td class="state-' + esc(b.state) + '">' +
      esc(b.state) + '</td><td>' + esc(b.reason) + '</td><td>' + esc(b.engine) + '</td><td>' + latency +
      '</td><td>' + esc(b.hits) + '</td><td>' + esc(b.traffic) + '</td><td>' + padded + '</td><td>' +
      esc(b.compile_seconds == null ? '' : b.compile_seconds.toFixed(1)) + '</td><td>' + tuning + '</td><td>' +
      explain + '</td></tr>';
  }
  function generation(g) {
    if (!g) { return ''; }
    var d = g.decoder, blocks = g.cache_blocks;
    return '<br><span class="generation">generation: a decoder of ' + esc(d.layers) + ' layers, ' + esc(d.heads) +
      ' heads, ' + esc(d.max_positions == null ? 'unbounded' : d.max_positions) + ' positions' +
      (g.tokenizer ? ', with its tokenizer' : '') + '; sequences running ' + esc(g.running) + ', waiting ' +
      esc(g.waiting) + (blocks ? '; cache blocks ' + esc(blocks.used) + ' of ' + esc(blocks.total) : '') + '</span>';
  }
  function modelSection(model) {
    var sig = (model.signature.inputs || []).map(function (i) {
      return esc(i.name) + ' ' + esc(i.dtype) + ' [' + esc(i.dims.join(', ')) + ']';
    }).join('; ');
    var admission = model.compile_admission || {};
    var batching = model.dynamic_batching ? (model.dynamic_batching.enabled ? 'on' : 'off') + ': ' +
      model.dynamic_batching.reason : 'none';
    return '<section class="model" data-model="' + esc(model.name) + '"><h3>' + esc(model.name) + ' v' +
      esc(model.version) + '</h3><p class="meta">inputs ' + sig + '<br>' + axes(model) +
      '<br>dynamic batching ' + esc(batching) + '; compiled buckets ' + esc(admission.compiled_buckets) +
      ' of ' + esc(admission.max_compiled_buckets) + (admission.storm ? '; <strong>compile storm</strong>' : '') +
      generation(model.generation) + '</p><table><thead><tr><th scope="col">bucket</th><th scope="col">state</th><th scope="col">reason</th>' +
      '<th scope="col">engine</th><th scope="col">latency ms</th><th scope="col">hits</th>' +
      '<th scope="col">traffic</th><th scope="col">padded error</th><th scope="col">compile s</th>' +
      '<th scope="col">tuning</th><th scope="col">explain</th></tr></thead><tbody>' +
      (model.buckets || []).map(function (b) { return bucketRow(model, b); }).join('') +
      '</tbody></table></section>';
  }
  function render(state) {
    var s = state.server, q = s.compile_queue, m = s.memory, c = s.kernel_cache;
    document.getElementById('health').textContent = s.ready ? 'ready' : 'not ready: waiting for ' + s.waiting.join(', ');
    document.getElementById('status').innerHTML =
      '<h2>Server</h2>' + cards([
        ['models', state.models.length],
        ['compiles queued / running', q.queued + ' / ' + q.running + ' (' + q.workers + ' workers)'],
        ['server memory', mib(m.server_bytes)], ['compile and tuning children', mib(m.children_bytes)],
        ['weights mapped', mib(m.weights_bytes)], ['memory limit', m.limit_bytes ? mib(m.limit_bytes) : 'none'],
        ['kernel cache', c.entries + ' of ' + c.max_entries + ', ' + mib(c.bytes)],
        ['JIT', s.jit ? 'on (' + s.routing + ' routing)' : 'off'], ['tuning', s.tuning ? 'on' : 'off']].concat(
        Object.keys(s.store_check || {}).map(function (k) {
          var r = s.store_check[k]; return ['store check: ' + k, r.ok + ' sound, ' + r.damaged + ' damaged'];
        }))) +
      '<h2>Models</h2>' + (state.models.length ? state.models.map(modelSection).join('') : '<p>None yet: upload one below.</p>');
    var select = document.getElementById('predict-model'), chosen = select.value;
    var names = state.models.map(function (x) { return x.name; });
    if (names.join('\\n') !== Array.prototype.map.call(select.options, function (o) { return o.value; }).join('\\n')) {
      select.innerHTML = names.map(function (n) { return '<option>' + esc(n) + '</option>'; }).join('');
      if (names.indexOf(chosen) >= 0) select.value = chosen;
    }
  }
  function getJson(path) {
    return fetch(path, {cache: 'no-store'}).then(function (r) {
      if (r.status >= 500 && path !== '/server') throw new Error(path + ': HTTP ' + r.status);
      return r.json();
    });
  }
  function poll() {
    Promise.all([getJson('/models'), getJson('/server')]).then(function (both) {
      render({models: both[0].models, server: both[1]});
      document.getElementById('error').textContent = '';
      document.getElementById('updated').textContent = 'updated ' + new Date().toLocaleTimeString();
    }).catch(function (e) {
      document.getElementById('error').textContent = 'cannot reach the server: ' + e.message;
    }).then(function () { setTimeout(poll, 1000); });
  }
  function show(id, response) {
    return response.text().then(function (text) {
      var body; try { body = JSON.stringify(JSON.parse(text)); } catch (e) { body = text; }
      document.getElementById(id).textContent = response.status + ' ' + body.slice(0, 2000);
    });
  }
  document.getElementById('upload-form').addEventListener('submit', function (event) {
    event.preventDefault();
    var name = document.getElementById('upload-name').value, form = new FormData();
    form.append('model', document.getElementById('upload-file').files[0]);
    var config = document.getElementById('upload-config').value.trim();
    if (config) form.append('config', new Blob([config], {type: 'application/json'}), 'config.json');
    var token = document.getElementById('upload-token').value, headers = {};
    if (token) headers.authorization = 'Bearer ' + token;
    var replace = document.getElementById('upload-replace').checked ? '?replace=true' : '';
    document.getElementById('upload-result').textContent = 'uploading...';
    fetch('/models/' + encodeURIComponent(name) + replace, {method: 'PUT', body: form, headers: headers})
      .then(function (r) { return show('upload-result', r); })
      .catch(function (e) { document.getElementById('upload-result').textContent = e.message; });
  });
  document.getElementById('predict-form').addEventListener('submit', function (event) {
    event.preventDefault();
    var inputs;
    try { inputs = JSON.parse(document.getElementById('predict-inputs').value); } catch (e) {
      document.getElementById('predict-result').textContent = 'the inputs are not JSON: ' + e.message; return;
    }
    var name = document.getElementById('predict-model').value;
    fetch('/models/' + encodeURIComponent(name) + '/predict', {method: 'POST',
      headers: {'content-type': 'application/json'}, body: JSON.stringify({inputs: inputs})})
      .then(function (r) { return show('predict-result', r); })
      .catch(function (e) { document.getElementById('predict-result').textContent = e.message; });
  });
  window.jitserveConsole = {render: render};
  poll();
})();
</script>
</body></html>
"""
