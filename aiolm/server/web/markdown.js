// A small, safe Markdown renderer for model answers.
//
// Safety comes from the order of work: the whole text is HTML-escaped first, so the only
// tags in the output are the ones built here; link targets must be http(s), mailto, or
// same-site paths, and the escaping means they can never close the href attribute.
// Covers what chat models write: code fences, inline code, bold / italic, headings,
// lists, block quotes, rules, links. Unclosed fences (a streaming answer) still render.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const HOLE = "\u0000"; // marks stashed spans; stripped from the input so it cannot be forged

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

function safeUrl(url) {
  if (url.includes(HOLE)) return null; // a code span inside the URL: not a link
  return /^(https?:\/\/|mailto:|\/(?!\/)|#)/i.test(url) ? url : null;
}

// Bold may hold whole italic spans and stars between spaces ("2 * 3"), nothing else with a
// star, so its tags and the star-italic pass's nest.
// "__" bold takes the same: its body may not hold a stray star either.
const STAR_SAFE = String.raw`(?:\*[^*\s](?:[^*\n]*?[^*\s])?\*|(?<=\s)\*(?=\s))`;
const STRONG = new RegExp(
  String.raw`\*\*(?=[^\s*])((?:[^*\n]|${STAR_SAFE})*?[^\s*])\*\*` +
    String.raw`|__(?=[^\s_*])((?:[^_*\n]|${STAR_SAFE})*?[^\s_*])__`,
  "g",
);

function emphasis(text) {
  return text
    .replace(STRONG, (_, a, b) => `<strong>${a ?? b}</strong>`)
    .replace(/\*(?=\S)([^*\n]*?\S)\*/g, "<em>$1</em>")
    .replace(/(^|[^\w])_(?=\S)([^_\n]*?\S)_(?![\w])/g, "$1<em>$2</em>");
}

// Inline spans of already-escaped text. Code spans and links are stashed first so that
// emphasis never reaches into code or into a URL.
function inline(text) {
  const stash = [];
  const keep = (html) => `${HOLE}${stash.push(html) - 1}${HOLE}`;
  // At most 16 backticks open a span: a long run of them stays linear.
  text = text.replace(/(`{1,16})([^`\n]+?)\1/g, (_, __, code) => keep(`<code>${code.trim()}</code>`));
  // A label holds no "[" (a line of them stays linear); a URL may hold one level of
  // balanced parentheses (Wikipedia's).
  text = text.replace(/\[([^[\]\n]+)\]\(((?:[^()\s]|\([^()\s]*\))+)\)/g, (whole, label, url) => {
    const href = safeUrl(url);
    return href ? keep(`<a href="${href}" target="_blank" rel="noopener noreferrer">${emphasis(label)}</a>`) : whole;
  });
  text = emphasis(text);
  // A stashed link's label may hold a stashed code span: restore until none is left (a
  // span only holds spans stashed before it, so this ends).
  const hole = new RegExp(`${HOLE}(\\d+)${HOLE}`, "g");
  while (text.includes(HOLE)) text = text.replace(hole, (_, i) => stash[Number(i)]);
  return text;
}

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
// The closing #s are cut in heading() by string work: a pattern for them backtracked
// cubically over a long run of spaces (a frozen tab while an answer streamed).
const HEADING = /^ {0,3}(#{1,6})(?:[ \t]+(.*))?$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^ {0,3}&gt;\s?(.*)$/;

// A heading's text without its optional closing sequence: spaces, then #s, at the end.
function headingText(text) {
  const trimmed = text.trimEnd();
  let end = trimmed.length;
  while (end > 0 && trimmed[end - 1] === "#") end -= 1; // a loop: /#+$/ is quadratic on a run of #
  if (end === trimmed.length) return trimmed;
  const open = trimmed.slice(0, end);
  return open === "" || /[ \t]$/.test(open) ? open.trimEnd() : trimmed;
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || ITEM.test(line) || QUOTE.test(line);
}

function codeBlock(lines, i, out) {
  const [, marker, lang] = lines[i].match(FENCE);
  const body = [];
  for (i += 1; i < lines.length; i += 1) {
    if (lines[i].trim().startsWith(marker) && /^[`~]+$/.test(lines[i].trim())) {
      i += 1;
      break;
    }
    body.push(lines[i]);
  }
  const cls = lang ? ` class="language-${lang}"` : "";
  out.push(`<pre><code${cls}>${body.join("\n")}</code></pre>`);
  return i;
}

function list(lines, i, out) {
  const first = lines[i].match(ITEM)[2];
  const ordered = /\d/.test(first);
  const items = [];
  for (; i < lines.length; i += 1) {
    const m = lines[i].match(ITEM);
    if (m && /\d/.test(m[2]) === ordered) {
      items.push({ depth: m[1].length, text: m[3] });
    } else if (lines[i].trim() && items.length && /^\s+/.test(lines[i]) && !startsBlock(lines[i])) {
      items[items.length - 1].text += ` ${lines[i].trim()}`; // a wrapped item continues
    } else {
      break;
    }
  }
  const tag = ordered ? "ol" : "ul";
  const start = ordered ? parseInt(first, 10) : 1;
  const attr = ordered && start !== 1 ? ` start="${start}"` : "";
  const base = Math.min(...items.map((it) => it.depth));
  const html = items.map((it) => {
    const nested = it.depth > base ? ' class="nested"' : "";
    return `<li${nested}>${inline(it.text)}</li>`;
  });
  out.push(`<${tag}${attr}>${html.join("")}</${tag}>`);
  return i;
}

/** Markdown text -> an HTML string that contains only tags made here. */
export function renderMarkdown(source) {
  const lines = escapeHtml(source.replaceAll(HOLE, "").replace(/\r\n?/g, "\n")).split("\n");
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i += 1;
    } else if (FENCE.test(line)) {
      i = codeBlock(lines, i, out);
    } else if ((m = line.match(HEADING))) {
      const level = m[1].length;
      out.push(`<h${level}>${inline(headingText(m[2] ?? ""))}</h${level}>`);
      i += 1;
    } else if (RULE.test(line)) {
      out.push("<hr>");
      i += 1;
    } else if (ITEM.test(line)) {
      i = list(lines, i, out);
    } else if (QUOTE.test(line)) {
      const quoted = [];
      for (; i < lines.length && (m = lines[i].match(QUOTE)); i += 1) quoted.push(m[1]);
      out.push(`<blockquote>${inline(quoted.join("\n")).replaceAll("\n", "<br>")}</blockquote>`);
    } else {
      const para = [];
      for (; i < lines.length && lines[i].trim() && (para.length === 0 || !startsBlock(lines[i])); i += 1) {
        para.push(lines[i].trim());
      }
      out.push(`<p>${inline(para.join("\n")).replaceAll("\n", "<br>")}</p>`);
    }
  }
  return out.join("\n");
}
