// What tests/browser_pages.py measures in a copy of a parity HTML page, once the page has loaded:
// content cut off or running off the page, each table's box, and chart labels that overlap or
// leave their drawing. The result is written into the DOM as JSON (a hidden pre element, id parity-measure),
// which Chromium's --dump-dom returns. No parity page holds this script.
(function () {
  var SLACK = 0.5;  // px: sub-pixel rounding of two boxes that only touch is not an overlap
  var doc = document.documentElement;
  function describe(el) {
    var text = el.tagName.toLowerCase();
    if (el.id) text += '#' + el.id;
    var cls = el.getAttribute('class');
    if (cls && cls.trim()) text += '.' + cls.trim().split(/\s+/).join('.');
    return text;
  }
  function ownText(el) {  // an SVG label's words, without its <title> tooltip
    var words = Array.prototype.filter.call(el.childNodes, function (n) { return n.nodeType === 3; })
      .map(function (n) { return n.nodeValue; }).join('').trim();
    return (words || el.textContent.trim()).slice(0, 80);
  }
  function scrolls(el) {
    var o = getComputedStyle(el).overflowX;
    return o === 'auto' || o === 'scroll';
  }
  function shown(rect) { return rect.width > 0 && rect.height > 0; }
  var r = {width: doc.clientWidth, page_scroll_width: doc.scrollWidth, overflows: [], tables: [],
           overlaps: [], clipped: [], labels: 0};

  // Content cut off: an element narrower than what it holds, where that element does not scroll
  // (overflow visible spills over its neighbours, hidden/clip cuts it off). The page itself must
  // never scroll sideways.
  if (doc.scrollWidth > doc.clientWidth)
    r.overflows.push({element: 'html', scroll: doc.scrollWidth, client: doc.clientWidth,
                      text: 'the page scrolls sideways'});
  document.querySelectorAll('body *').forEach(function (el) {
    if (el instanceof SVGElement || el.id === 'parity-measure' || el.closest('#parity-measure')) return;
    var display = getComputedStyle(el).display;
    if (display === 'inline' || display === 'none' || display === 'contents') return;  // no box of their own
    if (el.scrollWidth > el.clientWidth + 1 && !scrolls(el))
      r.overflows.push({element: describe(el), scroll: el.scrollWidth, client: el.clientWidth,
                        text: el.textContent.trim().slice(0, 80)});
  });

  // Each table: the box it is shown in (its nearest sideways-scrolling ancestor, else its parent)
  // and whether that box fits the window; a table without a scroll box must fit its parent.
  document.querySelectorAll('table').forEach(function (t) {
    var box = t.parentElement;
    while (box && box !== document.body && !scrolls(box)) box = box.parentElement;
    var scroller = box && box !== document.body ? box : null;
    var rect = t.getBoundingClientRect();
    var outer = (scroller || t.parentElement).getBoundingClientRect();
    var fits = scroller ? outer.right <= doc.clientWidth + SLACK
                        : rect.right <= Math.min(outer.right, doc.clientWidth) + SLACK;
    var head = t.tHead && t.tHead.rows.length ? Array.prototype.map.call(t.tHead.rows[0].cells, function (c) {
      return [c.textContent, Math.round(c.getBoundingClientRect().width)];
    }) : [];
    r.tables.push({element: describe(t), right: Math.round(rect.right), scroll_box: !!scroller,
                   box_right: Math.round(outer.right), fits: fits, head: head});
  });

  // Labels of one drawing (an SVG's text: axis ticks, titles, bar labels; a figure's legend items)
  // must not overlap one another, and an SVG's text must lie inside its SVG (which clips it).
  var groups = [];
  document.querySelectorAll('figure').forEach(function (f) { groups.push(f); });
  document.querySelectorAll('svg').forEach(function (s) { if (!s.closest('figure')) groups.push(s); });
  groups.forEach(function (group) {
    var labels = Array.prototype.slice.call(group.querySelectorAll('text, .legend li'))
      .map(function (el) { return {el: el, rect: el.getBoundingClientRect()}; })
      .filter(function (l) { return shown(l.rect); });
    r.labels += labels.length;
    for (var i = 0; i < labels.length; i++) {
      var a = labels[i].rect;
      for (var j = i + 1; j < labels.length; j++) {
        var b = labels[j].rect;
        var dx = Math.min(a.right, b.right) - Math.max(a.left, b.left);
        var dy = Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top);
        if (dx > SLACK && dy > SLACK)
          r.overlaps.push({where: describe(group), a: ownText(labels[i].el), b: ownText(labels[j].el),
                           by: [Math.round(dx * 10) / 10, Math.round(dy * 10) / 10]});
      }
    }
  });
  document.querySelectorAll('svg').forEach(function (s) {
    var frame = s.getBoundingClientRect();
    s.querySelectorAll('text').forEach(function (t) {
      var rect = t.getBoundingClientRect();
      if (shown(rect) && (rect.left < frame.left - SLACK || rect.right > frame.right + SLACK ||
                          rect.top < frame.top - SLACK || rect.bottom > frame.bottom + SLACK))
        r.clipped.push({where: describe(s), text: ownText(t),
                        box: [rect.left, rect.top, rect.right, rect.bottom].map(Math.round),
                        svg: [frame.left, frame.top, frame.right, frame.bottom].map(Math.round)});
    });
  });

  r.resources = performance.getEntriesByType('resource').map(function (e) { return e.name; });
  r.errors = window.__parityErrors || [];
  var pre = document.createElement('pre');
  pre.id = 'parity-measure';
  pre.hidden = true;
  pre.textContent = JSON.stringify(r);
  document.body.appendChild(pre);
})();
