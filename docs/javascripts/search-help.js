// Search in the reader's language: on the English site a query in Chinese finds nothing
// (the English pages are indexed without Chinese words), so the empty result says where
// to search instead, with a link that opens the Chinese site's search on the same query.
// On every site, result titles lose the zero-width spaces the Chinese word segmentation
// put between words for the index (they would be copied with the title).
(function () {
  var CJK = /[\u3400-\u9fff\uf900-\ufaff]/;
  var ZERO_WIDTH = /\u200b/g;
  var HAS_ZERO_WIDTH = /\u200b/; // no g flag: test() keeps no state between calls

  function chineseSearchUrl(query) {
    // On the English site the header's logo links to the site's root.
    var logo = document.querySelector("a.md-logo");
    var root = new URL(logo ? logo.getAttribute("href") : "/", window.location.href);
    var zh = new URL("zh/", root);
    zh.searchParams.set("q", query);
    return zh.href;
  }

  function update() {
    var input = document.querySelector("input.md-search__input");
    var meta = document.querySelector(".md-search-result__meta");
    document.querySelectorAll(".md-search-result__title, .md-search-result h1, .md-search-result h2")
      .forEach(function (title) {
        if (HAS_ZERO_WIDTH.test(title.textContent)) {
          title.innerHTML = title.innerHTML.replace(ZERO_WIDTH, "");
        }
      });
    if (!input || !meta) return;
    var query = input.value.trim();
    var english = document.documentElement.lang !== "zh";
    var empty = !document.querySelector(".md-search-result__item");
    var hint = meta.querySelector(".dmuon-search-hint");
    if (english && empty && CJK.test(query)) {
      if (!hint) {
        hint = document.createElement("a");
        hint.className = "dmuon-search-hint";
        meta.appendChild(document.createTextNode(" "));
        meta.appendChild(hint);
      }
      var text = "Search the Chinese pages (中文页面) for " + query;
      if (hint.textContent !== text) hint.textContent = text; // no mutation, no loop
      var href = chineseSearchUrl(query);
      if (hint.getAttribute("href") !== href) hint.setAttribute("href", href);
    } else if (hint) {
      hint.remove();
    }
  }

  // Only the search dialog changes what this reads: watching it alone keeps every other
  // change of the page (the header on scroll, the table of contents) free of this work.
  new MutationObserver(update).observe(
    document.querySelector(".md-search") || document.documentElement,
    { childList: true, subtree: true },
  );
})();
