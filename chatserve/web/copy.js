// Copy text to the clipboard, also where the Clipboard API is missing: pages served over plain
// http to another machine (http://<LAN-IP>:8000) are not a secure context, so navigator.clipboard
// is undefined there. The fallback selects the text in a hidden textarea and runs the copy command.

export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    try {
      await navigator.clipboard.writeText(text);
      return true;
    } catch {
      // permission refused (or no focus): try the old way
    }
  }
  return copyWithTextarea(text);
}

export function copyWithTextarea(text) {
  const area = document.createElement('textarea');
  area.value = text;
  area.setAttribute('readonly', '');
  area.style.position = 'fixed';
  area.style.top = '-1000px';
  area.style.opacity = '0';
  const focused = document.activeElement;
  document.body.append(area);
  area.select();
  area.setSelectionRange(0, text.length);
  let ok = false;
  try {
    ok = document.execCommand('copy');
  } catch {
    ok = false;
  }
  area.remove();
  if (focused && typeof focused.focus === 'function') focused.focus();
  return ok;
}

// A small "Copy" button: shows Copied / Copy failed for a moment.
export function copyButton(getText, { label = 'Copy', className = 'code-copy', testid = 'copy-button' } = {}) {
  const button = document.createElement('button');
  button.type = 'button';
  button.className = className;
  button.dataset.testid = testid;
  button.textContent = label;
  button.addEventListener('click', async (event) => {
    event.stopPropagation();
    const ok = await copyText(getText());
    button.textContent = ok ? 'Copied' : 'Copy failed';
    button.dataset.copied = ok ? '1' : '0';
    setTimeout(() => { button.textContent = label; }, 1200);
  });
  return button;
}
