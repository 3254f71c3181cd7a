// A small Markdown renderer for the chat page: fenced code blocks (with a
// copy button), inline code, bold, italics, headings, lists, links
// (http/https only) and paragraphs. Everything is escaped before any markup
// is made, so a model's text can never inject HTML. No dependencies, no build.
"use strict";

const markdown = (() => {
  const escape = (s) => s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;");

  // Inline markup on escaped text; code spans first, so their insides stay literal.
  function inline(text) {
    const codes = [];
    let s = escape(text).replace(/`([^`\n]+)`/g, (_, c) => `\u0000${codes.push(c) - 1}\u0000`);
    s = s.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^*])\*([^*\n]+)\*/g, "$1<em>$2</em>")
      .replace(/\[([^\]\n]+)\]\((https?:\/\/[^)\s]+)\)/g, '<a href="$2" target="_blank" rel="noopener">$1</a>');
    return s.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${codes[i]}</code>`);
  }

  // Blocks: a fenced block runs to its closing fence (or the end of the text
  // while it streams in); other lines group into lists, headings, paragraphs.
  function render(text) {
    const out = [];
    const lines = text.split("\n");
    let para = [], list = null;
    const flush = () => {
      if (para.length) out.push(`<p>${para.map(inline).join("<br>")}</p>`);
      if (list) out.push(`<${list.tag}>${list.items.map((i) => `<li>${inline(i)}</li>`).join("")}</${list.tag}>`);
      para = [];
      list = null;
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(/^\s*```\s*([\w+#.-]*)\s*$/);
      if (fence) {
        flush();
        const code = [];
        while (++i < lines.length && !/^\s*```\s*$/.test(lines[i])) code.push(lines[i]);
        const lang = fence[1] ? ` class="language-${escape(fence[1])}"` : "";
        out.push(`<div class="code"><button type="button" class="copy">Copy</button>`
                 + `<pre><code${lang}>${escape(code.join("\n"))}</code></pre></div>`);
        continue;
      }
      const heading = line.match(/^(#{1,6})\s+(.*)$/);
      const item = line.match(/^\s*([-*+]|\d+[.)])\s+(.*)$/);
      if (heading) {
        flush();
        out.push(`<h${heading[1].length}>${inline(heading[2])}</h${heading[1].length}>`);
      } else if (item) {
        const tag = /\d/.test(item[1]) ? "ol" : "ul";
        if (para.length || (list && list.tag !== tag)) flush();
        list = list || {tag, items: []};
        list.items.push(item[2]);
      } else if (!line.trim()) {
        flush();
      } else {
        if (list) flush();
        para.push(line);
      }
    }
    flush();
    return out.join("");
  }

  return {render};
})();
