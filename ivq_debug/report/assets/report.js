/* ivq-debug report: sortable / filterable layer table, heatmap readout. Data comes from data-* attributes
   and JSON data blocks; text is only ever set with textContent. */
(function () {
  "use strict";
  var each = function (list, fn) { Array.prototype.forEach.call(list, fn); };

  function sortKey(cell, numeric) {
    var v = cell.getAttribute("data-v");
    if (v === null) { v = cell.textContent; }
    if (!numeric) { return v.toLowerCase(); }
    return v === "" ? NaN : parseFloat(v);
  }

  each(document.querySelectorAll("table.sortable"), function (table) {
    var head = table.tHead ? table.tHead.rows[0].cells : [];
    each(head, function (th, col) {
      var kind = th.getAttribute("data-sort");
      if (!kind) { return; }
      th.tabIndex = 0;
      var go = function () {
        var asc = th.getAttribute("aria-sort") !== "ascending";
        each(head, function (h) { h.removeAttribute("aria-sort"); });
        th.setAttribute("aria-sort", asc ? "ascending" : "descending");
        var body = table.tBodies[0];
        var rows = Array.prototype.slice.call(body.rows);
        var numeric = kind === "num";
        var keyed = rows.map(function (r, i) { return [sortKey(r.cells[col], numeric), i, r]; });
        keyed.sort(function (a, b) {
          var x = a[0], y = b[0], c = 0;
          if (numeric) {
            var xn = isNaN(x), yn = isNaN(y);
            if (xn || yn) { return xn === yn ? a[1] - b[1] : (xn ? 1 : -1); }
            c = x < y ? -1 : (x > y ? 1 : 0);
          } else {
            c = x < y ? -1 : (x > y ? 1 : 0);
          }
          return (asc ? c : -c) || a[1] - b[1];
        });
        keyed.forEach(function (k) { body.appendChild(k[2]); });
      };
      th.addEventListener("click", go);
      th.addEventListener("keydown", function (e) {
        if (e.key === "Enter" || e.key === " ") { e.preventDefault(); go(); }
      });
    });
  });

  var table = document.getElementById("layer-table");
  var text = document.getElementById("layer-filter");
  var status = document.getElementById("layer-status");
  var part = document.getElementById("layer-part");
  var count = document.getElementById("layer-count");
  var apply = function () {};
  if (table && text && status && part && count) {
    var rows = Array.prototype.slice.call(table.tBodies[0].rows);
    var texts = rows.map(function (r) { return r.textContent.toLowerCase(); });
    apply = function () {
      var q = text.value.trim().toLowerCase(), st = status.value, pt = part.value, shown = 0;
      rows.forEach(function (r, i) {
        var ok = (!q || texts[i].indexOf(q) >= 0) &&
          (!st || (r.getAttribute("data-status") || "").split(" ").indexOf(st) >= 0) &&
          (!pt || r.getAttribute("data-part") === pt);
        r.hidden = !ok;
        if (ok) { shown += 1; }
      });
      count.textContent = shown + " of " + rows.length + " rows";
    };
    text.addEventListener("input", apply);
    status.addEventListener("change", apply);
    part.addEventListener("change", apply);
    apply();
  }

  var extra = document.getElementById("layer-extra");
  if (table && extra) {
    extra.addEventListener("change", function () { table.classList.toggle("hide-x", !extra.checked); });
  }

  var reveal = function () {
    var id = decodeURIComponent(location.hash.slice(1));
    var el = id ? document.getElementById(id) : null;
    if (el && el.hidden && text && status && part) {
      text.value = ""; status.value = ""; part.value = "";
      apply();
      el.scrollIntoView({ block: "center" });
    }
  };
  window.addEventListener("hashchange", reveal);
  reveal();

  each(document.querySelectorAll("svg.heatmap[data-heat]"), function (svg) {
    var id = svg.getAttribute("data-heat");
    var src = document.getElementById(id);
    var out = document.getElementById(id + "-readout");
    var area = svg.querySelector(".hm-area");
    if (!src || !out || !area) { return; }
    var data = JSON.parse(src.textContent);
    var cell = function (e) {
      var b = area.getBoundingClientRect();
      var c = Math.floor((e.clientX - b.left) / b.width * data.cols);
      var r = Math.floor((e.clientY - b.top) / b.height * data.rows);
      return (c < 0 || r < 0 || c >= data.cols || r >= data.rows) ? null : [r, c];
    };
    area.addEventListener("mousemove", function (e) {
      var rc = cell(e);
      if (!rc) { return; }
      var v = data.values[rc[0]][rc[1]];
      out.textContent = data.row_labels[rc[0]] + " \u00b7 " + data.col_labels[rc[1]] + " \u00b7 SQNR " +
        (v === null ? "no data" : v + " dB");
    });
    area.addEventListener("click", function (e) {
      var rc = cell(e);
      var target = rc ? data.links[rc[0]][rc[1]] : null;
      if (target !== null && target !== undefined) { location.hash = "L" + target; }
    });
  });
})();
